"""Golden fixtures for linmoe's C tests, from the independent PyTorch reference (linmoe_ref.py)
and fla's naive references.

    python3 scripts/reference/make_fixtures.py --fla peers/fla --out tests/fixtures [--require-fla]
    python3 scripts/reference/make_fixtures.py --no-fla --out /tmp/fx      (local, no fla)

(a) Agreement with fla (flash-linear-attention, git-ignored in peers/fla): on random inputs,
    linmoe_ref's KDA recurrence, chunked KDA, gate functions and AttnRes against fla's
    naive_recurrent_kda, naive_chunk_kda, naive_kda_gate, naive_kda_lowerbound_gate and
    naive_attnres. fla's naive functions hard-cast to fp32 (`.to(torch.float)`, `.float()`), so
    each is run twice: as written (fp32 math; our side fp64 on the same fp32-rounded inputs;
    must agree to 1e-5) and "promoted" (the same source executed with torch.float mapped to
    float64 and Tensor.float() keeping fp64 tensors; must agree to 1e-10). The fla functions
    are taken from fla's files by path: the file's own imports (torch, einops, ...) are run,
    except fla.* and triton ones, which the naive functions do not use, then just the naive
    function definitions are executed. A function whose dependencies are missing (einops,
    F.rms_norm of torch >= 2.4) is SKIPPED with a message; --require-fla makes any skip fatal.
(b) model_tiny.safetensors: configs/tiny.json in fp64 (token-by-token KDA), weights drawn here
    (see fixture_params) and rounded to fp32, B = 2, T = 40; logits, loss, d loss / d param;
    plus a packed variant (B = 1, cu_seqlens with an empty and a length-1 document).
(c) attnres_naive.safetensors: inputs of `linmoe op attnres` (tools/op_attnres.c: query,
    rms_weight, residual_0..4, do; __metadata__ eps, scale) and the expected outputs
    expected.{o, dquery, drms_weight, dresidual_i} from fla's naive_attnres + autograd in fp64.

Relative error everywhere: max |a - b| / max |b| over the tensor (max-norm relative).
"""

import argparse
import ast
import collections.abc
import contextlib
import importlib
import json
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.dont_write_bytecode = True  # no __pycache__ next to the sources
sys.path.insert(0, HERE)
import linmoe_ref as R  # noqa: E402
import safetensors_io  # noqa: E402

TOL_FP32 = 1e-5   # fla naive as written (fp32 math) vs linmoe_ref fp64
TOL_FP64 = 1e-10  # fla naive promoted to fp64 vs linmoe_ref fp64
TOL_SELF = 1e-10  # linmoe_ref chunked vs token-by-token KDA, fp64
ROUTER_GAP = 1e-3  # k-th vs (k+1)-th biased score, every token, every MoE layer

FLA_FUNCS = {
    "naive_recurrent_kda": "fla/ops/kda/naive.py",
    "naive_chunk_kda": "fla/ops/kda/naive.py",
    "naive_kda_gate": "fla/ops/kda/gate.py",
    "naive_kda_lowerbound_gate": "fla/ops/kda/gate.py",
    "naive_attnres": "fla/ops/attnres/naive.py",
}


def rel_err(a, b):
    a = torch.as_tensor(a).to(torch.float64)
    b = torch.as_tensor(b).to(torch.float64)
    den = b.abs().max().item()
    num = (a - b).abs().max().item()
    return num / den if den > 0 else num


# ============================================================================ fla loading

class _Promoted:
    """Stands in for the `torch` module inside fla's naive code: torch.float / torch.float32
    are float64, everything else is torch's."""

    def __init__(self, mod):
        self._mod = mod

    def __getattr__(self, name):
        if name in ("float", "float32"):
            return torch.float64
        return getattr(self._mod, name)


@contextlib.contextmanager
def _tensor_float_keeps_fp64():
    """Tensor.float() leaves fp64 tensors fp64 (for fla code that calls .float())."""
    orig = torch.Tensor.float

    def f(self, *a, **kw):
        return self if self.dtype == torch.float64 else orig(self, *a, **kw)

    torch.Tensor.float = f
    try:
        yield
    finally:
        torch.Tensor.float = orig


class FlaNaive:
    """fla's naive reference functions, loaded from fla's source files by path.

    self.native[name] / self.promoted[name]: the callables (absent when unavailable);
    self.missing[name]: why a function is unavailable."""

    def __init__(self, root):
        self.root = root
        self.native, self.promoted, self.missing = {}, {}, {}
        by_file = {}
        for fn, rel in FLA_FUNCS.items():
            by_file.setdefault(rel, []).append(fn)
        for rel, fns in by_file.items():
            path = os.path.join(root, rel)
            if not os.path.isfile(path):
                for fn in fns:
                    self.missing[fn] = f"{path} not found"
                continue
            with open(path) as f:
                tree = ast.parse(f.read(), filename=path)
            for mode, store in (("native", self.native), ("promoted", self.promoted)):
                ns, absent = self._imports(tree)
                if mode == "promoted":
                    ns["torch"] = _Promoted(torch)
                defs = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in fns]
                mod = ast.Module(body=[ast.ImportFrom(module="__future__",
                                                      names=[ast.alias(name="annotations")], level=0)]
                                 + defs, type_ignores=[])
                exec(compile(ast.fix_missing_locations(mod), path, "exec"), ns)
                for fn in fns:
                    if fn not in ns:
                        self.missing[fn] = f"no function {fn} in {path}"
                        continue
                    store[fn] = ns[fn]
                    if absent:
                        self.missing.setdefault(fn, "; ".join(absent))  # may still work: decided at call

    @staticmethod
    def _imports(tree):
        """Run a file's top-level imports except fla.* / triton*; return (namespace, failures)."""
        ns = {"__name__": "fla_naive_by_path", "Sequence": collections.abc.Sequence}
        absent = []
        for node in tree.body:
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] in ("fla", "triton"):
                        continue
                    try:
                        m = importlib.import_module(a.name)
                        if a.asname:
                            ns[a.asname] = m
                        else:
                            top = a.name.split(".")[0]
                            ns[top] = importlib.import_module(top)
                    except ImportError as e:
                        absent.append(f"import {a.name}: {e}")
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                if node.module.split(".")[0] in ("fla", "triton", "__future__"):
                    continue
                try:
                    m = importlib.import_module(node.module)
                    for a in node.names:
                        ns[a.asname or a.name] = getattr(m, a.name)
                except (ImportError, AttributeError) as e:
                    absent.append(f"from {node.module} import ...: {e}")
        return ns, absent

    def call(self, name, promoted, *args, **kw):
        """Run fla's `name`; returns (result, None) or (None, reason) when it cannot run here."""
        fn = (self.promoted if promoted else self.native).get(name)
        if fn is None:
            return None, self.missing.get(name, "not loaded")
        try:
            if promoted:
                with _tensor_float_keeps_fp64():
                    return fn(*args, **kw), None
            return fn(*args, **kw), None
        except (NameError, AttributeError, ImportError) as e:
            why = self.missing.get(name)
            return None, f"{type(e).__name__}: {e}" + (f" ({why})" if why else "")


# ============================================================================ (a) agreement

class Report:
    def __init__(self):
        self.rows, self.failed, self.skipped = [], [], []

    def check(self, name, err, tol):
        ok = err <= tol
        self.rows.append((name, err, tol, ok))
        print(f"  {name:58s} rel err {err:10.3e}  (tol {tol:.0e})  {'ok' if ok else 'FAIL'}")
        if not ok:
            self.failed.append(name)

    def skip(self, name, why):
        print(f"  {name:58s} SKIPPED: {why}")
        self.skipped.append(name)


def _rand_kda(gen, B, T, H, K, V, gate, dtype):
    """Random KDA inputs as the layer makes them: L2-normalised q, k; beta in (0, 1); g a
    log-decay from the given gate family (kda.md §1.3)."""
    n = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k = R.l2norm(n(B, T, H, K)), R.l2norm(n(B, T, H, K))
    v = n(B, T, H, V)
    beta = torch.sigmoid(n(B, T, H))
    if gate == "logsigmoid":      # fla's tests: moderate decay
        g = F.logsigmoid(n(B, T, H, K))
    elif gate == "bounded":       # down to the bound -5
        g = -5.0 * torch.sigmoid(2.0 * n(B, T, H, K))
    else:                         # softplus, beyond the bound
        g = -torch.exp(torch.rand(H, 1, generator=gen, dtype=torch.float64) * 2) * F.softplus(n(B, T, H, K) * 2)
    h0 = n(B, H, K, V)
    return [x.to(dtype) for x in (q, k, v, g, beta, h0)]


def check_fla(fla, rep, require):
    gen = torch.Generator().manual_seed(20240611)
    print("(a) linmoe_ref vs fla naive references")

    # --- self-consistency (needs no fla): chunked vs token-by-token, fp64
    for gate in ("logsigmoid", "bounded", "softplus"):
        q, k, v, g, beta, h0 = _rand_kda(gen, 2, 150, 2, 16, 12, gate, torch.float64)
        o1, s1 = R.kda_recurrent(q, k, v, g, beta, initial_state=h0)
        for C in (16, 64):
            o2, s2 = R.kda_chunk(q, k, v, g, beta, initial_state=h0, chunk_size=C)
            rep.check(f"ref kda_chunk(C={C}) vs ref kda_recurrent [{gate}] o", rel_err(o2, o1), TOL_SELF)
            rep.check(f"ref kda_chunk(C={C}) vs ref kda_recurrent [{gate}] state", rel_err(s2, s1), TOL_SELF)

    if fla is None:
        rep.skip("fla agreement checks", "no fla (--no-fla, or the --fla path is missing)")
        return

    def both(label, fn_name, mine_fn, make_args, modes=(False, True)):
        """Run fla's fn natively on fp32 inputs and promoted on fp64 inputs; compare each output
        with mine_fn on the same (fp32-rounded / fp64) inputs in fp64."""
        for promoted in modes:
            args64 = make_args()
            args = [a.to(torch.float32) if torch.is_tensor(a) and a.is_floating_point() and not promoted else a
                    for a in args64]
            ref_in = [a.to(torch.float64) if torch.is_tensor(a) and a.is_floating_point() else a for a in args]
            out, why = fla.call(fn_name, promoted, *args)
            tag = f"{label} [{'fp64 promoted' if promoted else 'fp32 as written'}]"
            if why is not None:
                rep.skip(tag, why)
                continue
            mine = mine_fn(*ref_in)
            outs = out if isinstance(out, (tuple, list)) else (out,)
            mins = mine if isinstance(mine, (tuple, list)) else (mine,)
            for j, (a, b) in enumerate(zip(mins, outs)):
                if b is None:
                    continue
                what = ("", " o", " final state")[j + 1] if len(mins) == 2 else ""
                rep.check(f"{tag}{what}", rel_err(a, b),
                          TOL_FP64 if promoted else TOL_FP32)

    # --- gates (inputs beyond the saturation points of softplus / sigmoid)
    H, K = 3, 16

    def softplus_args():
        g_raw = torch.randn(2, 33, H, K, generator=gen, dtype=torch.float64) * 3
        A = torch.log(torch.rand(H, generator=gen, dtype=torch.float64) * 15 + 1)
        return (g_raw, A, R.dt_bias_init((H * K,), gen))

    both("naive_kda_gate vs kda_gate_softplus", "naive_kda_gate",
         lambda g, A, dt: R.kda_gate_softplus(g, A, dt), softplus_args)
    for lb in (-5.0, -2.5):
        def bounded_args(lb=lb):  # fla signature (g, A_log, dt_bias, lower_bound, output_dtype)
            g_raw = torch.randn(2, 33, H, K, generator=gen, dtype=torch.float64) * 3
            A = torch.randn(H, generator=gen, dtype=torch.float64) * 0.5
            return (g_raw, A, R.dt_bias_init((H * K,), gen), lb)
        both(f"naive_kda_lowerbound_gate (lb={lb}) vs kda_gate_bounded", "naive_kda_lowerbound_gate",
             lambda g, A, dt, lb_: R.kda_gate_bounded(g, A, dt, lb_), bounded_args)

    # --- KDA recurrence and chunk form
    for gate in ("logsigmoid", "bounded", "softplus"):
        def mk(gate=gate, T=70):
            q, k, v, g, beta, h0 = _rand_kda(gen, 2, T, 2, 16, 12, gate, torch.float64)
            return (q, k, v, g, beta, None, h0, True)
        # fp32 as written only with fla's test-style moderate decay: with log-decays near the
        # bound, fp32 cumsums of g lose ~1e-5 relative in exp(G_r - G_i) and the comparison
        # would measure fla's fp32 rounding; those run promoted to fp64 only
        modes = (False, True) if gate == "logsigmoid" else (True,)
        both(f"naive_recurrent_kda [{gate}] vs kda_recurrent", "naive_recurrent_kda",
             lambda q, k, v, g, b, sc, h0, fs: R.kda_recurrent(q, k, v, g, b, sc, h0), mk, modes=modes)

        def mkc(gate=gate):
            q, k, v, g, beta, h0 = _rand_kda(gen, 2, 128, 2, 16, 12, gate, torch.float64)
            return (q, k, v, g, beta, None, h0, True, 64)
        both(f"naive_chunk_kda [{gate}] vs kda_chunk", "naive_chunk_kda",
             lambda q, k, v, g, b, sc, h0, fs, C: R.kda_chunk(q, k, v, g, b, sc, h0, chunk_size=C), mkc,
             modes=modes)
        both(f"naive_chunk_kda [{gate}] vs kda_recurrent", "naive_chunk_kda",
             lambda q, k, v, g, b, sc, h0, fs, C: R.kda_recurrent(q, k, v, g, b, sc, h0), mkc, modes=modes)

    # --- AttnRes forward and backward (autograd through both)
    for promoted in (False, True):
        tag = f"naive_attnres fwd+bwd [{'fp64 promoted' if promoted else 'fp32 as written'}]"
        q, w, srcs, do = attnres_inputs(gen, 5, 37, 48)
        dt = torch.float64 if promoted else torch.float32
        ins = [x.to(dt).requires_grad_() for x in [q, w] + srcs]
        out, why = fla.call("naive_attnres", promoted, ins[0], ins[2:], ins[1], None, AR_EPS, AR_SCALE)
        if why is not None:
            rep.skip(tag, why)
            continue
        gr = torch.autograd.grad(out, ins, do.to(dt))
        mine_in = [x.detach().to(torch.float64).requires_grad_() for x in ins]
        mo = R.attnres(mine_in[2:], mine_in[0], mine_in[1], AR_EPS, AR_SCALE)
        mg = torch.autograd.grad(mo, mine_in, do.to(torch.float64))
        tol = TOL_FP64 if promoted else TOL_FP32
        rep.check(tag + " o", rel_err(mo, out), tol)
        for nm, a, b in zip(["dquery", "drms_weight"] + [f"dresidual_{m}" for m in range(5)], mg, gr):
            rep.check(f"{tag} {nm}", rel_err(a, b), tol)

    if require and rep.skipped:
        rep.failed.append("required fla checks were skipped: " + ", ".join(rep.skipped))


# ============================================================================ (c) AttnRes fixture

AR_EPS = float(np.float32(1e-6))   # the op parses metadata eps "1e-06" into a float
AR_SCALE = 0.5                      # exact in fp32; != 1 so the scale attribute is exercised


def attnres_inputs(gen, L, N, D):
    """query N(0, 0.3) (not zero: p is not uniform), gain 1 + 0.2 N, sources of growing
    mean / spread (as a residual stream grows), do N(0, 1); all rounded to fp32."""
    n = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    r32 = lambda x: x.to(torch.float32).to(torch.float64)  # noqa: E731
    q = r32(0.3 * n(D))
    w = r32(1.0 + 0.2 * n(D))
    srcs = [r32(0.1 * m + (0.5 + 0.75 * m) * n(N, D)) for m in range(L)]
    do = r32(n(N, D))
    return q, w, srcs, do


def make_attnres_fixture(fla, path, standin):
    gen = torch.Generator().manual_seed(77)
    L, N, D = 5, 37, 48
    q, w, srcs, do = attnres_inputs(gen, L, N, D)
    ins = [x.clone().requires_grad_() for x in [q, w] + srcs]
    if standin:
        o = R.attnres(ins[2:], ins[0], ins[1], AR_EPS, AR_SCALE)
        src = "linmoe_ref.attnres (stand-in: --no-fla; not for tests/fixtures)"
    else:
        o, why = fla.call("naive_attnres", True, ins[0], ins[2:], ins[1], None, AR_EPS, AR_SCALE)
        if why is not None:
            sys.exit(f"make_fixtures: attnres fixture needs fla's naive_attnres, which cannot run here: "
                     f"{why}\n(pass --no-fla to use linmoe_ref's AR as a stand-in, for local tests only)")
        src = "fla naive_attnres promoted to fp64 + torch.autograd"
    grads = torch.autograd.grad(o, ins, do)
    f32 = lambda x: x.detach().to(torch.float32).numpy()  # noqa: E731
    t = {"query": f32(q), "rms_weight": f32(w)}
    for m in range(L):
        t[f"residual_{m}"] = f32(srcs[m])
    t["do"] = f32(do)
    t["expected.o"] = f32(o)
    t["expected.dquery"] = f32(grads[0])
    t["expected.drms_weight"] = f32(grads[1])
    for m in range(L):
        t[f"expected.dresidual_{m}"] = f32(grads[2 + m])
    meta = {"eps": "1e-06", "scale": repr(AR_SCALE), "expected_from": src,
            "generator": "scripts/reference/make_fixtures.py"}
    safetensors_io.save_file(t, path, meta)
    print(f"(c) wrote {path} ({os.path.getsize(path)} bytes; expected values from {src})")


# ============================================================================ (b) model fixture

def fixture_params(cfg, seed):
    """Weights that exercise every path (unlike the model init, where AttnRes queries and the
    router bias are 0 and matrices are tiny): matrices N(0, 1/fan_in), embeddings N(0, 1),
    norm gains 1 + 0.1 N, AttnRes queries N(0, 0.3), conv U(-0.5, 0.5), A_log log U(1, 16)
    (softplus layers, fla) or U(-0.5, 0.5) (bounded), dt_bias fla's init, router bias
    N(0, 0.05). Drawn in fp64 and rounded to fp32: the fixture's math uses the rounded values."""
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape, kind in R.param_table(cfg):
        if kind == "embed":
            x = rng.standard_normal(shape)
        elif kind == "matrix":
            x = rng.standard_normal(shape) / np.sqrt(shape[-1])
        elif kind == "norm":
            x = 1.0 + 0.1 * rng.standard_normal(shape)
        elif kind == "ar_query":
            x = 0.3 * rng.standard_normal(shape)
        elif kind == "conv":
            x = rng.uniform(-0.5, 0.5, shape)
        elif kind == "A_log":
            if cfg.gate[R._layer_of(name)] == "softplus":
                x = np.log(rng.uniform(1.0, 16.0, shape))
            else:
                x = rng.uniform(-0.5, 0.5, shape)
        elif kind == "dt_bias":
            x = R.dt_bias_init(shape, gen).numpy()
        elif kind == "buffer":
            x = 0.05 * rng.standard_normal(shape)
        else:
            raise AssertionError(kind)
        out[name] = torch.from_numpy(np.asarray(x, dtype=np.float64).astype(np.float32).astype(np.float64))
    return out


PACKED_CU = [0, 9, 9, 10, 27, 40]  # an empty and a length-1 document


def _run(model, ids, labels, cu=None):
    model.zero_grad(set_to_none=True)
    logits, loss, n = model(ids, labels, cu)
    loss.backward()
    # a parameter the forward never reads gets None from autograd: its gradient is 0
    # (layer 0's attn_res.* with AttnRes: sublayer 0 has a single source, passed through)
    grads = {nm: (model.p[nm].grad.detach().clone() if model.p[nm].grad is not None
                  else torch.zeros_like(model.p[nm])) for nm in model.param_names}
    return logits.detach(), loss.detach(), grads, dict(model.routes)


def router_margins(cfg, routes):
    """Smallest gap between the k-th and (k+1)-th selection keys over tokens, per MoE layer,
    and whether every expert got a token."""
    k = cfg.num_experts_per_tok
    out = {}
    for i, r in routes.items():
        ks = torch.sort(r.keys, dim=-1, descending=True).values
        gap = (ks[:, k - 1] - ks[:, k]).min().item() if k < cfg.num_experts else float("inf")
        used = torch.bincount(r.idx.reshape(-1), minlength=cfg.num_experts)
        out[i] = (gap, int((used > 0).sum()))
    return out


def make_model_fixture(cfg_path, path, seed0, rep):
    cfg_text = open(cfg_path).read()
    cfg = R.Config(json.loads(cfg_text))
    B, T = 2, 40
    for seed in range(seed0, seed0 + 1000):
        params = fixture_params(cfg, seed)
        rng = np.random.default_rng(10_000 + seed)
        ids = torch.from_numpy(rng.integers(0, cfg.vocab_size, (B, T)))
        labels = R.next_token_labels(ids)
        pids = torch.from_numpy(rng.integers(0, cfg.vocab_size, (1, T)))
        plabels = R.next_token_labels(pids, PACKED_CU)
        m = R.LinMoE(cfg, params, torch.float64, "recurrent")
        res = _run(m, ids, labels)
        pres = _run(m, pids, plabels, PACKED_CU)
        ok = True
        for rr in (res[3], pres[3]):
            for i, (gap, used) in router_margins(cfg, rr).items():
                ok &= gap > ROUTER_GAP and used == cfg.num_experts
        if ok:
            break
        print(f"(b) seed {seed}: a router margin <= {ROUTER_GAP} or an idle expert; resampling")
    else:
        sys.exit("make_fixtures: no seed with clear router margins found")
    print(f"(b) model fixture: {cfg_path}, seed {seed}, B={B} T={T}, packed cu_seqlens {PACKED_CU}")
    for tag, rr in (("batch", res[3]), ("packed", pres[3])):
        for i, (gap, used) in router_margins(cfg, rr).items():
            print(f"    {tag} layer {i}: min k/(k+1) key gap {gap:.3e}, experts used {used}/{cfg.num_experts}")

    # cross-checks: the chunked KDA path in fp64 and the whole model in fp32
    mc = R.LinMoE(cfg, params, torch.float64, "chunk")
    for tag, (lg, ls, gr, _), args in (("batch", res, (ids, labels)), ("packed", pres, (pids, plabels, PACKED_CU))):
        lc, lsc, grc, _ = _run(mc, *args)
        rep.check(f"model fp64 chunk vs recurrent [{tag}] logits", rel_err(lc, lg), TOL_SELF)
        rep.check(f"model fp64 chunk vs recurrent [{tag}] loss", rel_err(lsc, ls), TOL_SELF)
        rep.check(f"model fp64 chunk vs recurrent [{tag}] grads (worst)",
                  max(rel_err(grc[n], gr[n]) for n in gr), TOL_SELF)
    m32 = R.LinMoE(cfg, params, torch.float32, "recurrent")
    l32, s32, g32, _ = _run(m32, ids, labels)
    worst = max(gr_n for gr_n in (rel_err(g32[n], res[2][n]) for n in res[2]))
    print(f"    info: fp32 model vs fp64: logits {rel_err(l32, res[0]):.2e}, loss {rel_err(s32, res[1]):.2e}, "
          f"worst grad {worst:.2e}")
    zero = [n for n in res[2] if res[2][n].abs().max() == 0]
    expected_zero = [n for n in zero if cfg.residual != "standard" and n.startswith("model.layers.0.attn_res.")]
    print(f"    gradients identically 0 (parameter unused by the forward): {expected_zero}")
    for n in set(zero) - set(expected_zero):
        rep.check(f"grad.{n} is non-zero", 1.0, 0.0)

    f32 = lambda x: x.detach().to(torch.float32).numpy()  # noqa: E731
    t = {}
    for name, _, _ in R.param_table(cfg):
        t[name] = f32(params[name])
    t["input_ids"] = ids.to(torch.int32).numpy()
    t["labels"] = labels.to(torch.int32).numpy()
    t["logits"] = f32(res[0])
    t["loss"] = np.array([res[1].item()], dtype=np.float64)
    for n in m.param_names:
        t["grad." + n] = f32(res[2][n])
    t["packed.input_ids"] = pids.to(torch.int32).numpy()
    t["packed.labels"] = plabels.to(torch.int32).numpy()
    t["packed.cu_seqlens"] = np.array(PACKED_CU, dtype=np.int64)
    t["packed.logits"] = f32(pres[0])
    t["packed.loss"] = np.array([pres[1].item()], dtype=np.float64)
    for n in m.param_names:
        t["packed.grad." + n] = f32(pres[2][n])
    meta = {"config": cfg_text, "seed": str(seed),
            "math": "float64 from the fp32-rounded parameters; KDA token by token (linmoe_ref.kda_recurrent)",
            "generator": "scripts/reference/make_fixtures.py (linmoe_ref.py)"}
    safetensors_io.save_file(t, path, meta)
    size = os.path.getsize(path)
    print(f"(b) wrote {path} ({size} bytes); loss {res[1].item():.12f}, packed loss {pres[1].item():.12f}")
    if size > 2 * 1024 * 1024:
        rep.check("model fixture <= 2 MB", float(size), 2.0 * 1024 * 1024)


# ============================================================================ main

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fla", help="path of fla's source tree (github fla-org/flash-linear-attention)")
    ap.add_argument("--no-fla", action="store_true",
                    help="no fla: skip (a), and compute the AttnRes fixture with linmoe_ref as a stand-in")
    ap.add_argument("--require-fla", action="store_true", help="fail when any fla check is skipped")
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--config", default=os.path.join(REPO, "configs", "tiny.json"))
    ap.add_argument("--seed", type=int, default=0, help="first seed tried for the model fixture")
    args = ap.parse_args()
    if not args.no_fla and not args.fla:
        ap.error("--fla PATH or --no-fla is required")
    out = os.path.abspath(args.out)
    if args.no_fla and os.path.realpath(out) == os.path.realpath(os.path.join(REPO, "tests", "fixtures")):
        sys.exit("make_fixtures: --no-fla fixtures are stand-ins; refusing to write them to tests/fixtures")
    os.makedirs(out, exist_ok=True)
    print(f"torch {torch.__version__}, python {sys.version.split()[0]}")

    fla = None
    if not args.no_fla:
        if os.path.isdir(os.path.join(args.fla, "fla")):
            fla = FlaNaive(args.fla)
            print(f"fla source: {os.path.abspath(args.fla)}")
        else:
            print(f"fla: SKIPPED, no fla source tree at {args.fla!r} (expected {args.fla}/fla/ops/...)")
            if args.require_fla:
                sys.exit("make_fixtures: --require-fla and fla is missing")
    rep = Report()
    check_fla(fla, rep, args.require_fla)
    make_model_fixture(args.config, os.path.join(out, "model_tiny.safetensors"), args.seed, rep)
    if fla is None and not args.no_fla:
        sys.exit("make_fixtures: the attnres fixture needs fla's naive_attnres (or --no-fla for a stand-in)")
    make_attnres_fixture(fla, os.path.join(out, "attnres_naive.safetensors"), standin=args.no_fla)
    if rep.skipped:
        print(f"skipped: {len(rep.skipped)} check(s): " + "; ".join(rep.skipped))
    if rep.failed:
        sys.exit("make_fixtures: FAILED: " + "; ".join(rep.failed))
    worst = max((e for _, e, _, _ in rep.rows), default=0.0)
    print(f"all {len(rep.rows)} checks passed (worst rel err {worst:.3e})")


if __name__ == "__main__":
    main()
