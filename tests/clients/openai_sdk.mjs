// The official OpenAI Node SDK (package `openai`, pinned by scripts/install-test-clients.sh)
// against `linmoe serve` (tests/scripts/server_clients.sh node): completions and chat
// completions, streamed and not; a bad request surfaces as the SDK's 400 error.
// Usage: node openai_sdk.mjs BASE_URL   (e.g. http://127.0.0.1:PORT/v1). Exit 0 = pass.
import { createRequire } from "node:module";
import path from "node:path";
import { fileURLToPath } from "node:url";
import assert from "node:assert/strict";

const here = path.dirname(fileURLToPath(import.meta.url));
const require = createRequire(path.join(here, "node_modules", "openai", "package.json"));
const { default: OpenAI } = await import(require.resolve("openai"));
const pkg = require("./package.json");

const client = new OpenAI({ baseURL: process.argv[2], apiKey: process.env.LINMOE_API_KEY || "none", maxRetries: 0 });
const prompt = "The jury said";

const models = await client.models.list();
assert.ok(models.data.length === 1 && typeof models.data[0].id === "string");
const model = models.data[0].id;

// completions: not streamed, then streamed; greedy, so the texts agree
const c = await client.completions.create({ model, prompt, max_tokens: 24, temperature: 0 });
assert.equal(c.object, "text_completion");
assert.equal(typeof c.choices[0].text, "string");
assert.ok(["stop", "length"].includes(c.choices[0].finish_reason));
assert.equal(c.usage.prompt_tokens > 0, true);
assert.equal(c.usage.total_tokens, c.usage.prompt_tokens + c.usage.completion_tokens);
let streamed = "", chunks = 0, usage = null;
for await (const ch of await client.completions.create({ model, prompt, max_tokens: 24, temperature: 0, stream: true })) {
  streamed += ch.choices[0]?.text ?? "";
  if (ch.usage) usage = ch.usage;
  chunks++;
}
assert.equal(streamed, c.choices[0].text);
assert.ok(chunks >= 2);
assert.deepEqual(usage.completion_tokens, c.usage.completion_tokens);

// chat completions: not streamed, then streamed
const messages = [{ role: "system", content: "You are terse." }, { role: "user", content: "Tell me about the city." }];
const r = await client.chat.completions.create({ model, messages, max_tokens: 24, temperature: 0 });
assert.equal(r.object, "chat.completion");
assert.equal(r.choices[0].message.role, "assistant");
let chat = "", role = null;
const stream = await client.chat.completions.create({ model, messages, max_tokens: 24, temperature: 0, stream: true });
for await (const ch of stream) {
  const d = ch.choices[0]?.delta;
  if (d?.role) role = d.role;
  chat += d?.content ?? "";
}
assert.equal(role, "assistant");
assert.equal(chat, r.choices[0].message.content);

// seeded sampling is reproducible
const s1 = await client.completions.create({ model, prompt, max_tokens: 16, temperature: 0.9, seed: 7 });
const s2 = await client.completions.create({ model, prompt, max_tokens: 16, temperature: 0.9, seed: 7 });
assert.equal(s1.choices[0].text, s2.choices[0].text);

// a bad field: the SDK's BadRequestError, status 400, naming the parameter
try {
  await client.completions.create({ model, prompt, max_tokens: -5 });
  assert.fail("max_tokens -5 was accepted");
} catch (e) {
  assert.ok(e instanceof OpenAI.BadRequestError, String(e));
  assert.equal(e.status, 400);
  assert.equal(e.param, "max_tokens");
}
console.log(`openai ${pkg.version}: completions and chat, streamed (${chunks} chunks) and not, agree; ` +
            `seeded sampling reproducible; 400 surfaces as BadRequestError(param=max_tokens)`);
