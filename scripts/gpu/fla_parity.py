"""fla parity (issue 22): a linmoe checkpoint exported with `linmoe export --format fla`
loads into fla's KDAForCausalLM, and fla's mean cross-entropy on a batch agrees with
linmoe's on the same batch within --tol (0.01) relative, in fp32 and under bf16 autocast.

    PYTHONPATH=peers/fla python3 scripts/gpu/fla_parity.py --ckpt CKPT [--fla-dir DIR]
        [--linmoe BIN] [--shard SHARD | --seed S] [--batch B] [--seq-len T]
        [--tokenizer auto|byte|gpt2] [--gpt2-dir data/gpt2] [--work DIR] [--threads N]
        [--device cuda] [--tol 0.01] [--bf16-tol 0.01] [--allow-eps-mismatch]
        [--cpu-reference] [--autotune first|full] [--json OUT] [--dry-run | --skip-fla]

The batch: B documents of T tokens each, written as a linmoe token shard (LMTOKENS v1,
include/linmoe/shard.h: every document followed by <|endoftext|>) under --work. The
tokens are the first B*T tokens of --shard (a shard file or a manifest of shards) that
are not <|endoftext|> (real text, the shard's vocab picks the tokenizer: 257 byte, 50257
GPT-2), or without --shard uniform
random ids of the tokenizer's vocab (<|endoftext|> excluded) drawn with --seed.

linmoe's loss: `linmoe eval --ckpt CKPT --val BATCH --seq-len T --passkey-lengths none`
(the CPU engine, fp32). Its pinned protocol (include/linmoe/eval.h) scores each
T-token document as one window from a fresh state, input [<|endoftext|>, d_0 .. d_{T-2}]
predicting d_0 .. d_{T-1}; loss = nll_nats / tokens (mean over the B*T predictions, nats).

fla's loss: KDAForCausalLM.from_pretrained(FLA_DIR) (no missing, unexpected or
mismatched tensor allowed), eval mode, use_cache=False, on the same [B, T] inputs; CE of
its logits (cast to fp32) against the same labels, mean over the B*T positions, once in
fp32 and once under torch.autocast(cuda, bfloat16). T > 64 keeps fla's KDA layers on
chunk_kda (eval mode switches to fused_recurrent_kda at q_len <= 64).

FLA_DIR: --fla-dir when it holds a config.json; otherwise the script exports CKPT there
(default WORK/fla) with `linmoe export --format fla` first (--allow-eps-mismatch passed on).

Environment: PYTHONPATH=peers/fla makes fla importable (the device tool carries peers/fla);
fla's model needs transformers and einops besides torch and triton. The GPU image has no
flash_attn: fla's Attention layers then get a stand-in, torch's scaled_dot_product_attention
(causal, scale head_dim^-0.5, kv heads repeated for GQA), patched into fla.layers.attn.
The linmoe binary: --linmoe, else $LINMOE_BIN, else build-gpu/linmoe (scripts/gpu/pack.sh)
or build/linmoe; a lib/ folder beside it goes on LD_LIBRARY_PATH (pack.sh copies the
shared libraries the bare GPU image lacks there). --tokenizer gpt2 needs data/gpt2
(vocab.json, merges.txt; git-ignored: carry it).

--dry-run prints the plan (paths, commands, shapes) and touches nothing: no torch, fla or
linmoe needed (a syntax and argument check on any machine). --skip-fla runs the linmoe
half (export, batch, eval) and prints linmoe's loss, without torch or fla.

--cpu-reference adds a row computed without fla: a plain-torch fp64 restatement of what
fla's KDAForCausalLM computes (reference_loss below), from the exported files on the CPU.
It checks the export (names, shapes, the gate mapping) anywhere torch runs; the fla rows
stay the acceptance test.

Output: a table on stdout and a JSON record (--json OUT, else $OUT/fla_parity.json when
$OUT is set): linmoe_loss, fla_fp32_loss, fla_bf16_loss, fla_fp32_rel_diff,
fla_bf16_rel_diff (reference_loss, reference_rel_diff with --cpu-reference), tol,
bf16_tol, pass, batch, seq_len, tokens, source. Exit status: 0 when every relative
difference is within its tolerance, 1 when one is not or a step fails, 2 for bad
arguments.
"""

import argparse
import json
import math
import os
import random
import shutil
import struct
import subprocess
import sys
from array import array

SHARD_MAGIC = b"LMTOKENS"
SHARD_VERSION = 1
TOKENIZERS = {"byte": (257, 256), "gpt2": (50257, 50256)}  # vocab, <|endoftext|>


def fail(msg, code=1):
    print(f"fla_parity: {msg}", file=sys.stderr)
    sys.exit(code)


def repo_root():
    return os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


def resolve_ckpt(path):
    """A checkpoint directory as given, or a run directory's newest checkpoint: the one
    RUN/ckpt/latest names (as `linmoe eval --ckpt` resolves it)."""
    if os.path.isfile(os.path.join(path, "model.safetensors")):
        return path
    for ckdir in (os.path.join(path, "ckpt"), path):
        latest = os.path.join(ckdir, "latest")
        if os.path.isfile(latest):
            with open(latest) as f:
                name = f.read().strip()
            if name and os.path.isfile(os.path.join(ckdir, name, "model.safetensors")):
                return os.path.join(ckdir, name)
    return path


def read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        fail(f"cannot read {path}: {e}")


# ---------------------------------------------------------------- token shards


def write_shard(path, vocab, tokens):
    """LMTOKENS v1: magic, version, vocab, width, reserved, count (little-endian), tokens."""
    width = 2 if vocab <= 65536 else 4
    data = array("H" if width == 2 else "I", tokens)
    if data.itemsize != width:
        fail(f"array item size {data.itemsize} != shard width {width} on this platform")
    if sys.byteorder != "little":
        data.byteswap()
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(SHARD_MAGIC + struct.pack("<IIIIQ", SHARD_VERSION, vocab, width, 0, len(tokens)))
        f.write(data.tobytes())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_shard(path, max_tokens):
    """(vocab, the first max_tokens tokens) of a linmoe shard, header checked, or of a
    manifest ("format": "linmoe-shards": its shards read as one stream, in order)."""
    with open(path, "rb") as f:
        is_manifest = f.read(64).lstrip()[:1] == b"{"
    if is_manifest:
        m = read_json(path)
        if m.get("format") != "linmoe-shards" or not isinstance(m.get("shards"), list):
            fail(f"{path}: not a linmoe shard manifest (format {m.get('format')!r})")
        vocab, toks = m.get("vocab"), []
        for e in m["shards"]:
            if len(toks) >= max_tokens:
                break
            sp = e.get("path", "")
            sp = sp if os.path.isabs(sp) else os.path.join(os.path.dirname(path), sp)
            v, t = read_shard_file(sp, max_tokens - len(toks))
            if v != vocab:
                fail(f"{path}: shard {sp} has vocab {v}, the manifest {vocab}")
            toks += t
        return vocab, toks
    return read_shard_file(path, max_tokens)


def read_shard_file(path, max_tokens):
    with open(path, "rb") as f:
        head = f.read(32)
        if len(head) != 32 or head[:8] != SHARD_MAGIC:
            fail(f"{path}: not a linmoe token shard (magic)")
        version, vocab, width, reserved, count = struct.unpack("<IIIIQ", head[8:])
        if version != SHARD_VERSION or width not in (2, 4) or reserved != 0:
            fail(f"{path}: version {version}, width {width}, reserved {reserved} (want 1, 2|4, 0)")
        n = min(count, max_tokens)
        data = array("H" if width == 2 else "I")
        data.frombytes(f.read(n * width))
        if len(data) != n:
            fail(f"{path}: truncated ({len(data)} of {n} tokens)")
    if sys.byteorder != "little":
        data.byteswap()
    return vocab, list(data)


def build_batch(args, model_vocab):
    """(tokenizer name, docs [B][T], source text). Docs hold no <|endoftext|>."""
    B, T = args.batch, args.seq_len
    if args.shard:
        # a shard's tokens include separators; read enough to skip them
        vocab, toks = read_shard(args.shard, 4 * B * T + 1024)
        names = [k for k, (v, _) in TOKENIZERS.items() if v == vocab]
        if not names:
            fail(f"{args.shard}: vocab {vocab} is neither byte (257) nor GPT-2 (50257)")
        tok = names[0]
        eot = TOKENIZERS[tok][1]
        toks = [t for t in toks if t != eot][: B * T]
        if len(toks) < B * T:
            fail(f"{args.shard}: only {len(toks)} non-separator tokens among the first read, "
                 f"want {B * T}")
        src = f"shard {args.shard} (first {B * T} tokens)"
    else:
        tok = args.tokenizer
        if tok == "auto":
            gpt2_ok = all(os.path.isfile(os.path.join(args.gpt2_dir, f))
                          for f in ("vocab.json", "merges.txt"))
            tok = "gpt2" if model_vocab >= 50257 and gpt2_ok else "byte"
        vocab, eot = TOKENIZERS[tok]
        rng = random.Random(args.seed)
        toks = []
        while len(toks) < B * T:
            t = rng.randrange(vocab)
            if t != eot:
                toks.append(t)
        src = f"uniform random {tok} token ids, seed {args.seed}"
    if TOKENIZERS[tok][0] > model_vocab:
        fail(f"the {tok} tokenizer's vocab {TOKENIZERS[tok][0]} exceeds the model's "
             f"vocab_size {model_vocab}")
    return tok, [toks[b * T:(b + 1) * T] for b in range(B)], src


# ---------------------------------------------------------------- linmoe


def find_linmoe(arg):
    root = repo_root()
    for c in ([arg] if arg else []) + [os.environ.get("LINMOE_BIN"),
                                       os.path.join(root, "build-gpu", "linmoe"),
                                       os.path.join(root, "build", "linmoe")]:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return os.path.abspath(c)
    if arg:
        fail(f"--linmoe {arg}: not an executable file")
    fail("no linmoe binary (give --linmoe, set LINMOE_BIN, or build build-gpu/ or build/)")


def linmoe_env(binary):
    env = dict(os.environ)
    lib = os.path.join(os.path.dirname(binary), "lib")
    if os.path.isdir(lib):
        env["LD_LIBRARY_PATH"] = lib + (":" + env["LD_LIBRARY_PATH"]
                                        if env.get("LD_LIBRARY_PATH") else "")
    return env


def run(cmd, env):
    print("+ " + " ".join(cmd), flush=True)
    r = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if r.returncode != 0:
        sys.stderr.write(r.stdout + r.stderr)
        fail(f"{os.path.basename(cmd[0])} {cmd[1]} exited with {r.returncode}")
    return r.stdout


def export_cmd(binary, ckpt, fla_dir, args):
    cmd = [binary, "export", "--ckpt", ckpt, "--format", "fla", "--out", fla_dir]
    if args.allow_eps_mismatch:
        cmd.append("--allow-eps-mismatch")
    return cmd


def eval_cmd(binary, ckpt, shard, tok, args, out_json):
    cmd = [binary, "eval", "--ckpt", ckpt, "--val", shard, "--tokenizer", tok,
           "--seq-len", str(args.seq_len), "--passkey-lengths", "none", "--json", out_json]
    if tok == "gpt2":
        cmd += ["--gpt2-dir", args.gpt2_dir]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    return cmd


def linmoe_loss(eval_json, B, T):
    r = read_json(eval_json)
    nll, tokens, windows = r.get("nll_nats"), r.get("tokens"), r.get("windows")
    if not isinstance(nll, (int, float)) or tokens != B * T or windows != B:
        fail(f"{eval_json}: nll_nats {nll}, tokens {tokens}, windows {windows} "
             f"(want a number, {B * T}, {B})")
    return nll / tokens


# ---------------------------------------------------------------- fla


def sdpa_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                         window_size=(-1, -1), **kwargs):
    """flash_attn_func's contract on [B, T, H, D] tensors through torch SDPA: query head h
    reads kv head h // (Hq / Hkv) (flash-attn's GQA map), default scale D^-0.5."""
    import torch.nn.functional as F
    if tuple(window_size) != (-1, -1) or dropout_p != 0.0:
        raise NotImplementedError("SDPA stand-in: no sliding window, no dropout")
    hq, hkv = q.shape[2], k.shape[2]
    if hq != hkv:
        k = k.repeat_interleave(hq // hkv, dim=2)
        v = v.repeat_interleave(hq // hkv, dim=2)
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       is_causal=causal, scale=softmax_scale)
    return o.transpose(1, 2).contiguous()


def sdpa_flash_attn_varlen_func(*args, **kwargs):
    raise NotImplementedError("SDPA stand-in: varlen is not needed (no attention_mask / "
                              "cu_seqlens in this check)")


def first_config_autotune():
    """Every Triton autotuner keeps only its first config (patched before fla is imported).
    This check compares losses, not speed, and a fresh GPU machine otherwise compiles every
    config of every fla kernel (minutes: Triton's cache does not survive the machine)."""
    try:
        from triton.runtime import autotuner
    except ImportError:
        return False
    orig = autotuner.Autotuner.__init__

    def init(self, fn, arg_names, configs, *args, **kwargs):
        orig(self, fn, arg_names, list(configs)[:1], *args, **kwargs)

    autotuner.Autotuner.__init__ = init
    return True


def import_fla(autotune="first"):
    try:
        import torch  # noqa: F401
    except ImportError as e:
        fail(f"torch is not importable: {e}")
    if autotune == "first" and first_config_autotune():
        print("fla_parity: Triton autotuning limited to each kernel's first config (--autotune full "
              "restores it)")
    try:
        import fla.layers.attn as fla_attn
        from fla.models import KDAForCausalLM
    except ImportError as e:
        fail(f"fla's KDAForCausalLM is not importable ({e}); run with PYTHONPATH=peers/fla "
             f"(fla needs transformers, einops and triton)")
    attn_impl = "flash_attn"
    if getattr(fla_attn, "flash_attn_func", None) is None:
        fla_attn.flash_attn_func = sdpa_flash_attn_func
        fla_attn.flash_attn_varlen_func = sdpa_flash_attn_varlen_func
        attn_impl = "torch SDPA stand-in for flash_attn"
    return KDAForCausalLM, attn_impl


def verify_weights(model, fla_dir):
    """Every parameter of the loaded model equals the file's tensor of the same name
    (bitwise after the cast to fp32), so a re-initialisation during loading is named here
    rather than seen as a loss difference; tied lm_head.weight is the embedding."""
    import torch
    from safetensors.torch import load_file
    file = load_file(os.path.join(fla_dir, "model.safetensors"))
    state = model.state_dict()
    tied = bool(model.config.tie_word_embeddings)
    for name, t in state.items():
        if name not in file:
            if tied and name == "lm_head.weight":
                t_src = file["model.embeddings.weight"]
            else:
                fail(f"{fla_dir}: the model's {name} {tuple(t.shape)} is not in the file")
        else:
            t_src = file[name]
        if tuple(t.shape) != tuple(t_src.shape) or not torch.equal(
                t.detach().cpu(), t_src.to(torch.float32)):
            fail(f"{fla_dir}: {name} of the loaded KDAForCausalLM differs from the file's "
                 "(re-initialised or reshaped while loading)")
    extra = sorted(set(file) - set(state))
    if extra:
        fail(f"{fla_dir}: tensors the model does not have: {extra[:5]}")


def fla_losses(fla_dir, docs, eot, device, autotune="first"):
    import torch
    import torch.nn.functional as F
    KDAForCausalLM, attn_impl = import_fla(autotune)
    if device == "cuda" and not torch.cuda.is_available():
        fail("no CUDA device (fla's Triton kernels need one)")
    model, info = KDAForCausalLM.from_pretrained(fla_dir, output_loading_info=True)
    bad = {k: v for k, v in info.items() if k != "error_msgs" and v}
    if bad or info.get("error_msgs"):
        fail(f"{fla_dir} does not load cleanly into KDAForCausalLM: {info}")
    model = model.to(device=device, dtype=torch.float32).eval()
    verify_weights(model, fla_dir)
    labels = torch.tensor(docs, dtype=torch.long, device=device)
    ids = torch.cat([torch.full_like(labels[:, :1], eot), labels[:, :-1]], dim=1)
    out = {"attention": attn_impl, "errors": {}}
    for name, ctx in (("fp32", None), ("bf16", torch.bfloat16)):
        try:
            with torch.no_grad():
                if ctx is None:
                    logits = model(input_ids=ids, use_cache=False).logits
                else:
                    with torch.autocast(device_type=device, dtype=ctx):
                        logits = model(input_ids=ids, use_cache=False).logits
                loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                       labels.reshape(-1)).item()
            del logits
        except Exception as e:  # noqa: BLE001  one precision failing still reports the other
            print(f"fla_parity: fla's {name} forward failed: {e!r}", file=sys.stderr)
            out["errors"][name] = repr(e)[:300]
            loss = float("nan")
        out[name] = loss
    return out


# ---------------------------------------------------------------- CPU reference


def read_safetensors_f64(path):
    """{name: fp64 tensor} of a safetensors file (F32 / BF16 / F16), torch only."""
    import torch
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    dts = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        b0, b1 = e["data_offsets"]
        if e["dtype"] not in dts:
            fail(f"{path}: tensor {name} has dtype {e['dtype']}")
        raw = bytearray(data[b0:b1])
        t = (torch.frombuffer(raw, dtype=torch.int16).view(dts[e["dtype"]]) if e["dtype"] != "F32"
             else torch.frombuffer(raw, dtype=torch.float32)) if raw else torch.empty(0)
        out[name] = t.reshape(e["shape"]).to(torch.float64)
    return out


def reference_loss(fla_dir, docs, eot):
    """Mean CE of the exported model, computed in fp64 on the CPU from FLA_DIR's files by a
    plain-torch restatement of what fla's KDAForCausalLM computes (read from its source:
    modeling_kda.py KDABlock / KDAModel, layers/kda.py, layers/attn.py, modules/rotary.py,
    ops/kda/gate.py, the recurrence of ops/kda/naive.py naive_recurrent_kda, l2norm eps 1e-6
    in chunk_kda). Checks the export's names, shapes and gate mapping without fla or a GPU;
    it is not fla's code, so the fla rows remain the acceptance test."""
    import torch
    import torch.nn.functional as F
    cfg = read_json(os.path.join(fla_dir, "config.json"))
    Wt = read_safetensors_f64(os.path.join(fla_dir, "model.safetensors"))
    eps, L = cfg["norm_eps"], cfg["num_hidden_layers"]
    d, H, K = cfg["hidden_size"], cfg["num_heads"], cfg["head_dim"]
    attn = cfg.get("attn")
    attn_layers = set(attn["layers"]) if attn else set()
    lb = cfg.get("lower_bound")

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    def lin(x, name):
        y = x @ Wt[name + ".weight"].T
        return y + Wt[name + ".bias"] if name + ".bias" in Wt else y

    labels = torch.tensor(docs, dtype=torch.long)
    ids = torch.cat([torch.full_like(labels[:, :1], eot), labels[:, :-1]], dim=1)
    B, T = ids.shape
    h = Wt["model.embeddings.weight"][ids]

    def kda(x, p):
        C = H * K

        def conv(y, name):  # nn.Conv1d(C, C, W, groups=C, padding=W-1), first T outputs
            w = Wt[name + ".weight"]
            z = F.conv1d(y.transpose(1, 2), w, padding=w.shape[-1] - 1, groups=C)[..., :T]
            return F.silu(z).transpose(1, 2)

        def l2n(y):
            return y / torch.sqrt(y.pow(2).sum(-1, keepdim=True) + 1e-6)

        q = l2n(conv(lin(x, p + "q_proj"), p + "q_conv1d").reshape(B, T, H, K)) * K ** -0.5
        k = l2n(conv(lin(x, p + "k_proj"), p + "k_conv1d").reshape(B, T, H, K))
        v = conv(lin(x, p + "v_proj"), p + "v_conv1d").reshape(B, T, H, K)
        g = lin(lin(x, p + "f_proj.0"), p + "f_proj.1").reshape(B, T, H, K)
        g = g + Wt[p + "dt_bias"].reshape(H, K)
        a = Wt[p + "A_log"].reshape(H, 1).exp()
        g = lb * torch.sigmoid(a * g) if lb is not None else -a * F.softplus(g)
        beta = torch.sigmoid(lin(x, p + "b_proj"))
        S = x.new_zeros(B, H, K, K)
        o = torch.empty_like(v)
        for t in range(T):
            S = S * g[:, t].exp()[..., None]
            kt = k[:, t]
            u = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhk,bhkv->bhv", kt, S))
            S = S + kt[..., None] * u[..., None, :]
            o[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t], S)
        gate = lin(lin(x, p + "g_proj.0"), p + "g_proj.1").reshape(B, T, H, K)
        o = rms(o, Wt[p + "o_norm.weight"]) * torch.sigmoid(gate)
        return lin(o.reshape(B, T, C), p + "o_proj")

    def attention(x, p):
        Hq = attn["num_heads"]
        Hkv = attn.get("num_kv_heads") or Hq
        D = d // Hq
        q = lin(x, p + "q_proj").reshape(B, T, Hq, D)
        k = lin(x, p + "k_proj").reshape(B, T, Hkv, D)
        v = lin(x, p + "v_proj").reshape(B, T, Hkv, D)
        inv = 1.0 / (float(attn.get("rope_theta", 10000.0))
                     ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
        ang = torch.arange(T, dtype=torch.float64)[:, None] * inv[None]
        cos, sin = ang.cos()[:, None], ang.sin()[:, None]

        def rot(y):  # non-interleaved: y * cos + rotate_half(y) * sin
            y1, y2 = y[..., : D // 2], y[..., D // 2:]
            return torch.cat([y1 * cos - y2 * sin, y2 * cos + y1 * sin], dim=-1)

        q, k = rot(q), rot(k).repeat_interleave(Hq // Hkv, dim=2)
        v = v.repeat_interleave(Hq // Hkv, dim=2)
        s = torch.einsum("bqhd,bkhd->bhqk", q, k) * D ** -0.5
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        o = torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v)
        return lin(o.reshape(B, T, Hq * D), p + "o_proj")

    for i in range(L):
        p = f"model.layers.{i}."
        x = rms(h, Wt[p + "attn_norm.weight"])
        h = h + (attention(x, p + "attn.") if i in attn_layers else kda(x, p + "attn."))
        x = rms(h, Wt[p + "mlp_norm.weight"])
        h = h + lin(F.silu(lin(x, p + "mlp.gate_proj")) * lin(x, p + "mlp.up_proj"),
                    p + "mlp.down_proj")
    h = rms(h, Wt["model.norm.weight"])
    head = Wt.get("lm_head.weight", Wt["model.embeddings.weight"])
    logits = h @ head.T
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)).item()


# ---------------------------------------------------------------- main


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", required=True, help="linmoe checkpoint or run directory")
    ap.add_argument("--fla-dir", help="exported fla directory (default WORK/fla; exported "
                    "there when it has no config.json)")
    ap.add_argument("--linmoe", help="linmoe binary")
    ap.add_argument("--shard", help="take the batch's tokens from this linmoe token shard")
    ap.add_argument("--seed", type=int, default=1234, help="random batch seed (default 1234)")
    ap.add_argument("--batch", type=int, default=4, help="documents B (default 4)")
    ap.add_argument("--seq-len", type=int, default=512, help="tokens per document T (512)")
    ap.add_argument("--tokenizer", choices=("auto", "byte", "gpt2"), default="auto",
                    help="random batch: tokenizer (auto: gpt2 when the model's vocab and "
                    "--gpt2-dir allow it, else byte)")
    ap.add_argument("--gpt2-dir", default=os.path.join(repo_root(), "data", "gpt2"))
    ap.add_argument("--work", default=None, help="work directory, kept (default "
                    "/tmp/fla_parity.PID, removed after a pass)")
    ap.add_argument("--threads", type=int, default=0, help="linmoe eval threads (OpenMP's)")
    ap.add_argument("--device", default="cuda", help="torch device for fla (cuda)")
    ap.add_argument("--tol", type=float, default=0.01, help="fp32 relative tolerance")
    ap.add_argument("--bf16-tol", type=float, default=0.01, help="bf16 relative tolerance")
    ap.add_argument("--allow-eps-mismatch", action="store_true",
                    help="passed to linmoe export (rms_norm_eps != 1e-5 with KDA layers)")
    ap.add_argument("--json", help="write the JSON record here")
    ap.add_argument("--autotune", choices=("first", "full"), default="first",
                    help="fla's Triton autotuning: each kernel's first config (default: a "
                         "correctness check, and minutes faster) or the full search")
    ap.add_argument("--cpu-reference", action="store_true",
                    help="also compare with a plain-torch fp64 CPU restatement of fla's model "
                    "computed from the exported files (no fla needed)")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true", help="print the plan, do nothing")
    mode.add_argument("--skip-fla", action="store_true", help="only the linmoe half")
    args = ap.parse_args()
    if args.batch < 1 or args.seq_len < 2:
        fail(f"--batch {args.batch} / --seq-len {args.seq_len} (want >= 1 / >= 2)", 2)
    if args.seq_len <= 64:
        print("fla_parity: note: T <= 64 runs fla's KDA layers through fused_recurrent_kda "
              "(eval mode), not chunk_kda", file=sys.stderr)

    args.ckpt = resolve_ckpt(args.ckpt)
    cfg_path = os.path.join(args.ckpt, "config.json")
    if not os.path.isfile(cfg_path):
        fail(f"{args.ckpt}: no config.json (give a checkpoint or run directory)", 2)
    cfg = read_json(cfg_path)
    model_vocab = int(cfg.get("vocab_size", 0))
    # not under $OUT: the export is as large as the checkpoint
    work = args.work or f"/tmp/fla_parity.{os.getpid()}"
    fla_dir = args.fla_dir or os.path.join(work, "fla")
    need_export = not os.path.isfile(os.path.join(fla_dir, "config.json"))
    shard = os.path.join(work, "batch.tokens")
    eval_json = os.path.join(work, "linmoe_eval.json")
    out_json = args.json or (os.path.join(os.environ["OUT"], "fla_parity.json")
                             if os.environ.get("OUT") else None)

    if args.dry_run:
        binary = args.linmoe or os.environ.get("LINMOE_BIN") or "build-gpu/linmoe"
        tok = "from the shard" if args.shard else args.tokenizer
        print(f"plan (dry run): checkpoint {args.ckpt} (vocab_size {model_vocab}, "
              f"{cfg.get('num_hidden_layers')} layers, hidden {cfg.get('hidden_size')})")
        if need_export:
            print("  1. " + " ".join(export_cmd(binary, args.ckpt, fla_dir, args)))
        else:
            print(f"  1. use the export in {fla_dir}")
        print(f"  2. batch: {args.batch} documents x {args.seq_len} tokens, tokenizer {tok}, "
              + (f"from {args.shard}" if args.shard else f"random, seed {args.seed}")
              + f" -> {shard}")
        print("  3. " + " ".join(eval_cmd(binary, args.ckpt, shard, "TOKENIZER", args,
                                          eval_json)))
        print(f"  4. fla: KDAForCausalLM.from_pretrained({fla_dir}) on {args.device}, inputs "
              f"[{args.batch}, {args.seq_len}] = [<|endoftext|>, d_0 .. d_T-2], mean CE in fp32 "
              "and bf16 autocast")
        print(f"  5. pass when |fla - linmoe| / linmoe <= {args.tol} (fp32) and <= "
              f"{args.bf16_tol} (bf16); JSON to {out_json or '(none)'}")
        return 0

    binary = find_linmoe(args.linmoe)
    env = linmoe_env(binary)
    os.makedirs(work, exist_ok=True)
    if need_export:
        if os.path.isdir(fla_dir) and os.listdir(fla_dir):
            fail(f"{fla_dir} exists without a config.json; remove it or name another --fla-dir")
        run(export_cmd(binary, args.ckpt, fla_dir, args), env)
    tok, docs, source = build_batch(args, model_vocab)
    vocab, eot = TOKENIZERS[tok]
    flat = []
    for d in docs:
        flat += d + [eot]
    write_shard(shard, vocab, flat)
    run(eval_cmd(binary, args.ckpt, shard, tok, args, eval_json), env)
    lm = linmoe_loss(eval_json, args.batch, args.seq_len)
    rec = {"name": "fla_parity", "ckpt": args.ckpt, "fla_dir": fla_dir, "batch": args.batch,
           "seq_len": args.seq_len, "tokens": args.batch * args.seq_len, "tokenizer": tok,
           "source": source, "linmoe_loss": lm, "tol": args.tol, "bf16_tol": args.bf16_tol}
    print(f"linmoe loss (CPU fp32, linmoe eval): {lm:.6f} nats/token over "
          f"{args.batch} x {args.seq_len} tokens ({source})")
    ok = True
    rows = []
    if args.cpu_reference:
        rows.append(("reference fp64", "reference", reference_loss(fla_dir, docs, eot),
                     args.tol))
    if not args.skip_fla:
        fl = fla_losses(fla_dir, docs, eot, args.device, args.autotune)
        rec["attention"] = fl["attention"]
        if fl["errors"]:
            rec["errors"] = fl["errors"]
        print(f"fla attention layers: {fl['attention']}")
        rows += [("fla fp32", "fla_fp32", fl["fp32"], args.tol),
                 ("fla bf16", "fla_bf16", fl["bf16"], args.bf16_tol)]
    if rows:
        print(f"{'':18}{'loss':>12}{'rel diff':>12}{'tol':>8}")
        print(f"{'linmoe fp32':18}{lm:12.6f}")
    for name, key, loss, tol in rows:
        rel = abs(loss - lm) / abs(lm) if lm != 0 else float("inf")
        rel = rel if rel == rel else float("inf")  # a NaN loss (failed forward) fails
        rec[f"{key}_loss"] = loss  # fla_fp32_loss, fla_bf16_loss, reference_loss
        rec[f"{key}_rel_diff"] = rel
        ok = ok and rel <= tol
        print(f"{name:18}{loss:12.6f}{rel:12.2e}{tol:8.3g}  {'ok' if rel <= tol else 'FAIL'}")
    rec["pass"] = ok if rows else None
    rec = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
           for k, v in rec.items()}  # strict JSON: no NaN / Infinity
    if out_json:
        os.makedirs(os.path.dirname(os.path.abspath(out_json)), exist_ok=True)
        with open(out_json, "w") as f:
            json.dump(rec, f, indent=1)
            f.write("\n")
    if not args.work and ok:
        shutil.rmtree(work, ignore_errors=True)
    elif not ok:
        print(f"fla_parity: FAIL; the batch, linmoe's eval JSON and the export are in {work}",
              file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
