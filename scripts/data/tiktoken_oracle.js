#!/usr/bin/env node
// The tokenizer oracle's other half: encodes texts with js-tiktoken (r50k_base, the
// GPT-2 encoding) so tests/test_tokenizer_oracle.c can require linmoe's GPT-2 ids to
// be identical. js-tiktoken comes from scripts/fetch-data.sh (NPM_DIR/node_modules).
//
//   node scripts/data/tiktoken_oracle.js NPM_DIR OUT ITEM...
//
// ITEM is `text:PATH` (the whole file is one text) or `docs:PATH` (the file holds
// documents separated by lines holding only "\f", the data/brown format; every
// non-empty document is encoded and followed by <|endoftext|> 50256, as
// `linmoe tokenize --doc-sep ff` does). Files must be valid UTF-8 (JS strings cannot
// hold anything else; a byte-order mark is kept as text). OUT gets one line per ITEM:
// the ids, separated by spaces. A literal "<|endoftext|>" in a text is encoded as
// ordinary text (no special tokens allowed or disallowed), as linmoe does.
'use strict';
const fs = require('fs');
const path = require('path');
const { createRequire } = require('module');

function die(msg) {
    process.stderr.write(`tiktoken_oracle: ${msg}\n`);
    process.exit(1);
}
if (process.argv.length < 5) die('usage: tiktoken_oracle.js NPM_DIR OUT text:PATH|docs:PATH...');
const [npmDir, outPath, ...items] = process.argv.slice(2);

// Resolve through NPM_DIR/node_modules, honouring the packages' "exports" maps.
const req = createRequire(path.resolve(npmDir, 'package.json'));
let Tiktoken, ranks;
try {
    ({ Tiktoken } = req('js-tiktoken/lite'));
    ranks = req('js-tiktoken/ranks/r50k_base');
} catch (e) {
    die(`cannot load js-tiktoken from ${npmDir}/node_modules (run scripts/fetch-data.sh): ${e.message}`);
}
const enc = new Tiktoken(ranks);
const EOT = 50256;
const utf8 = new TextDecoder('utf-8', { fatal: true, ignoreBOM: true });

function encodeText(s) {
    return enc.encode(s, [], []);
}

const lines = [];
for (const item of items) {
    const m = /^(text|docs):(.*)$/s.exec(item);
    if (!m) die(`bad item '${item}' (want text:PATH or docs:PATH)`);
    let s;
    try {
        s = utf8.decode(fs.readFileSync(m[2]));
    } catch (e) {
        die(`${m[2]}: ${e.message}`);
    }
    let ids = [];
    if (m[1] === 'text') {
        ids = encodeText(s);
    } else {
        // split into lines keeping their "\n"; a line "\f\n" (or a final "\f") ends a document
        let doc = '';
        const flush = () => {
            if (doc.length) ids.push(...encodeText(doc), EOT);
            doc = '';
        };
        let pos = 0;
        while (pos < s.length) {
            const nl = s.indexOf('\n', pos);
            const end = nl < 0 ? s.length : nl + 1;
            const line = s.slice(pos, end);
            if (line === '\f\n' || (nl < 0 && line === '\f')) flush();
            else doc += line;
            pos = end;
        }
        flush();
    }
    lines.push(ids.join(' '));
}
fs.writeFileSync(outPath, lines.join('\n') + '\n');
