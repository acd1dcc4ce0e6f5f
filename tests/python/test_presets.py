"""Named presets (docs/routing.md, section 10) against float64 NumPy models
of each family's router, written from what the family's Hugging Face
transformers modeling file does (its router's forward), on random,
bf16 and adversarial inputs: exact ties, underflow, saturated sigmoids,
sums of chosen weights so small that the family's epsilon shows.

The models compute in float64. Where the family's code holds an fp32
tensor (the scores its torch.topk compares and its weights are gathered
from, the biased scores), the model rounds that tensor to fp32, so that
the values fp32 makes equal (underflowed scores, saturated sigmoids) tie
in the model too and an underflowed score weighs 0 as it does there.
Exact ties go to the lower index: moecl's documented order; torch.topk
leaves the order of equal values unspecified, so the adversarial inputs
are built where that rule is the only thing that decides (the tie is exact
in fp32 on every device) and the test states it. A group limit's score
sums two keys, so groups made of different keys that sum to the same value
tie in the model but may rank either way on a device whose scores are an
ulp off; the model then accepts each such order (route.group_sets).
Families whose torch.topk runs with sorted=False (DeepSeek-V2/V3/V4,
MiniMax-M2) give their ids in no particular order; the model lists them in
moecl's order (descending key, ties to the lower index), and the weights
follow the ids.

Ids are compared exactly wherever the model's choice is unambiguous, and
within the rounding of fp32 keys (routing_ref.check_ids) on random inputs,
where two keys a few ulps apart may legitimately swap. Weights agree within
rtol = (E + k + 32) * 2^-24 plus atol = |scale| * 2^-126: an fp32 softmax
score is a sum of E exponentials and a divide (at most E + 8 roundings),
a renormalisation k + 2 more, sqrt/log1p/exp a few ulps each; atol covers
scores that underflow in fp32 (the model keeps e^-150, moecl has 0).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import moecl
import routing_ref as ref
from routing_ref import to_bf16_bits

try:
    import ml_dtypes
except ImportError:  # raw bf16 bit patterns serve as well
    ml_dtypes = None

NAMES = ("mixtral", "qwen3-moe", "qwen3-next", "deepseek-v2", "deepseek-v3", "deepseek-v4", "llama4", "gpt-oss",
         "glm-4.5", "kimi-k2", "minimax-m2", "gemma4", "olmoe")
EPS_20 = 1e-20  # DeepSeek-V3's `topk_weights.sum(...) + 1e-20`, and its followers'


def f32(a):
    """A float64 array rounded to fp32 and back (fp32's ties and underflow)."""
    return np.asarray(a, np.float64).astype(np.float32).astype(np.float64)


def softmax64(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def sigmoid64(x):
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-x))


def sqrtsoftplus64(x):
    """torch's F.softplus (threshold 20: x itself above), then sqrt; the
    exponential rounded to fp32 as the family's fp32 softplus holds it, so
    that e^x below fp32's range is 0 there too."""
    with np.errstate(over="ignore"):
        return np.sqrt(np.where(x > 20, x, np.log1p(f32(np.exp(np.minimum(x, 20))))))


def top(key, k):
    """The k entries first by key: descending, ties to the lower index."""
    return ref.spec_order(key)[:k]


# ---------------------------------------------------------------------------
# The families' routers. Each takes a row of logits x (float64) and the
# correction bias (float64, zeros where the family has none), and returns
# (key, ids, weigh): the key its top-k compared (fp32-rounded), its ids in
# moecl's order, and weigh(ids) -> the weights the family gives those ids.
# ---------------------------------------------------------------------------

def softmax_topk(k, norm):
    """Mixtral, Qwen3-MoE, Qwen3-Next, Gemma 4 (before its per-expert
    scale), OLMoE: softmax(router_logits, dtype=float32), torch.topk of the
    probabilities, then `/= sum` when norm_topk_prob (Mixtral always)."""
    def route(x, bias):
        p = f32(softmax64(x))

        def weigh(ids):
            w = p[ids]
            return w / w.sum() if norm else w
        return p, top(p, k), weigh
    return route


def deepseek_v2(x, bias):
    """modeling_deepseek_v2: softmax scores; group_limited_greedy: each of
    8 groups scored by its max, the top 3 groups kept, the others' scores
    masked_fill'ed with 0.0, topk(6) of that (sorted=False); the weights are
    the masked scores times routed_scaling_factor 16 (norm_topk_prob false)."""
    p = f32(softmax64(x))
    groups = p.reshape(8, -1).max(axis=1)
    kept = np.repeat(np.isin(np.arange(8), top(groups, 3)), x.size // 8)
    masked = np.where(kept, p, 0.0)

    def weigh(ids):
        return np.where(kept[ids], p[ids], 0.0) * 16.0
    return masked, top(masked, 6), weigh


def biased_sigmoid(k, scale, eps, groups=0, topk_group=0, score=sigmoid64):
    """DeepSeek-V3 (groups 8, kept 4), GLM-4.5 and Kimi K2 (n_group 1),
    DeepSeek-V4 (sqrtsoftplus, no groups), MiniMax-M2 (eps 0, scale 1):
    scores of the fp32 logits; scores + e_score_correction_bias choose
    (fp32 add); with groups, each group scored by the sum of its two largest
    choice scores, topk_group groups kept and the rest masked_fill'ed with
    0.0; topk(k) of that; the weights are the unbiased scores gathered,
    divided by their sum + eps (eps 1e-20; MiniMax-M2 the plain sum), times
    routed_scaling_factor. kept_groups: the kept groups when the caller
    gives them (one of route.group_sets), else the model's own."""
    def group_scores(key):
        """Each group's two largest keys (an (groups, 2) array) and score."""
        two = np.sort(key.reshape(groups, -1), axis=1)[:, ::-1][:, :2]
        return two, f32(two[:, 0] + two[:, 1])

    def route(x, bias, kept_groups=None):
        s = f32(score(x))
        key = f32(s + bias)
        if groups:
            _, gscore = group_scores(key)
            chosen = top(gscore, topk_group) if kept_groups is None else kept_groups
            kept = np.repeat(np.isin(np.arange(groups), chosen), x.size // groups)
            key = np.where(kept, key, 0.0)

        def weigh(ids):
            w = s[ids]
            return w / (w.sum() + eps) * scale
        return key, top(key, k), weigh

    def group_sets(x, bias, rtol):
        """Every set of groups the device may keep. A device score is within
        rtol of the model's key (a sigmoid an ulp off), so two groups whose
        scores are equal, or near, but made of different keys may rank
        either way on a device; groups made of the same keys score the
        same bits everywhere and keep the lower index first. Each class of
        groups with the same two keys near the boundary takes every order
        (ties included) against the others."""
        two, gscore = group_scores(f32(f32(score(x)) + bias))
        err = rtol * np.abs(two).sum(axis=1) + 2.0**-24 * np.abs(gscore)
        order = top(gscore, groups)
        edge = order[topk_group - 1]
        with np.errstate(invalid="ignore"):
            near = np.flatnonzero(np.abs(gscore - gscore[edge]) <= err + err[edge])
        classes = sorted({tuple(two[g]) for g in near})
        if len(classes) <= 1 or len(classes) > 6:
            return [top(gscore, topk_group)]
        above = [g for g in order[:topk_group] if g not in near]
        sets = set()
        for levels in itertools.product(range(len(classes)), repeat=len(classes)):
            level = {g: levels[classes.index(tuple(two[g]))] for g in near}
            ranked = sorted(near, key=lambda g: (-level[g], g))  # ties: lower index
            sets.add(tuple(sorted((above + ranked)[:topk_group])))
        return [list(c) for c in sorted(sets)]

    if groups:
        route.group_sets = group_sets
    return route


def llama4(x, bias):
    """modeling_llama4 (Llama4Router): torch.topk of the router logits, the
    chosen scattered into a row of -inf, sigmoid of that row in fp32: the
    chosen weigh sigmoid(logit)."""
    key = f32(x)
    return key, top(key, 1), lambda ids: sigmoid64(x[ids])


def gpt_oss(x, bias):
    """modeling_gpt_oss (GptOssTopKRouter): torch.topk(router_logits, 4),
    then softmax over the 4 values chosen."""
    key = f32(x)
    return key, top(key, 4), lambda ids: softmax64(x[ids])


MODELS = {
    "mixtral": softmax_topk(2, True),
    "qwen3-moe": softmax_topk(8, True),
    "qwen3-next": softmax_topk(10, True),
    "deepseek-v2": deepseek_v2,
    "deepseek-v3": biased_sigmoid(8, 2.5, EPS_20, groups=8, topk_group=4),
    "deepseek-v4": biased_sigmoid(6, 2.5, EPS_20, score=sqrtsoftplus64),
    "llama4": llama4,
    "gpt-oss": gpt_oss,
    "glm-4.5": biased_sigmoid(8, 2.5, EPS_20),
    "kimi-k2": biased_sigmoid(8, 2.827, EPS_20),
    "minimax-m2": biased_sigmoid(8, 1.0, 0.0),
    "gemma4": softmax_topk(8, True),
    "olmoe": softmax_topk(8, False),
}

BIASED = {"deepseek-v3", "deepseek-v4", "glm-4.5", "kimi-k2", "minimax-m2"}
SIGMOID_FAMILIES = {"deepseek-v3", "glm-4.5", "kimi-k2", "minimax-m2"}
EPS_FAMILIES = {"deepseek-v3", "deepseek-v4", "glm-4.5", "kimi-k2"}


# ---------------------------------------------------------------------------
# Running a preset and comparing
# ---------------------------------------------------------------------------

def shape(name):
    e, _ = moecl.preset_shape(name)
    return e, moecl.preset(name)["top_k"]


def tolerances(name):
    e, k = shape(name)
    scale = abs(moecl.preset(name)["scale"])
    return (e + k + 32) * 2.0**-24, scale * 2.0**-126


def run(ctx, name, x32, bias32=None, dtype="f32"):
    """The preset on fp32 logits x32 (rounded to bf16 first for dtype bf16):
    (weights, ids, the logits as the device saw them in float64)."""
    if dtype == "bf16":
        bits = to_bf16_bits(x32)
        arg = bits.view(ml_dtypes.bfloat16) if ml_dtypes is not None else bits
        w, ids = ctx.topk_gating(arg, bias=bias32, dtype=None if ml_dtypes is not None else "bf16",
                                 **moecl.preset(name))
        return w, ids, ref.widen(bits, "bf16")
    w, ids = ctx.topk_gating(x32, bias=bias32, **moecl.preset(name))
    return w, ids, x32.astype(np.float64)


def bias_for(name, rng, experts, zero=False):
    if name not in BIASED:
        return None
    if zero:
        return np.zeros(experts, np.float32)
    return (rng.standard_normal(experts) * 0.1).astype(np.float32)


def near_tie(key, want, k, tol):
    """Whether two of the model's first k + 1 keys differ, but by no more
    than their rounding: then the device may order them either way."""
    order = ref.spec_order(key)[:k + 1]
    a, b = key[order[:-1]], key[order[1:]]
    with np.errstate(invalid="ignore"):
        return bool(((a != b) & (np.abs(a - b) <= tol[order[:-1]] + tol[order[1:]])).any())


def check(name, w, ids, x, bias32, exact, what, g_err=None):
    """Every row against the family's model: ids exactly (exact: unless the
    model's keys have a near tie that is not exact) or within the keys'
    fp32 rounding (routing_ref.check_ids), weights within tolerances(name).
    g_err: the router's bound on each logit's error (fp32 dot products),
    which widens both."""
    e, k = shape(name)
    rtol, atol = tolerances(name)
    b = np.zeros(e) if bias32 is None else bias32.astype(np.float64)
    assert ids.shape == w.shape == (x.shape[0], k)
    model = MODELS[name]
    for t in range(x.shape[0]):
        label = "%s %s row %d" % (name, what, t)
        # A logit error d moves a softmax weight by a factor of up to e^2d,
        # a sigmoid or a key of up to d: 3d covers both.
        d = 0.0 if g_err is None else 3 * float(g_err[t].max())
        sets = model.group_sets(x[t], b, rtol + d) if hasattr(model, "group_sets") else [None]
        for i, kept in enumerate(sets):  # the first set the device's ids fit
            key, want, weigh = model(x[t], b) if kept is None else model(x[t], b, kept)
            tol = (rtol + d) * np.abs(key) + d + 2.0**-126
            try:
                if exact and not near_tie(key, want, k, tol):
                    np.testing.assert_array_equal(ids[t], want, err_msg=label)
                else:
                    ref.check_ids(ids[t], key, np.ones(e, bool), want, tol, label)
                break
            except AssertionError:
                if i == len(sets) - 1:
                    raise
        expect = weigh(ids[t])
        ok = np.abs(w[t] - expect) <= (rtol + d) * np.abs(expect) + atol
        assert ok.all(), "%s: weights %s, model %s" % (label, w[t].tolist(), expect.tolist())


# ---------------------------------------------------------------------------
# The tests
# ---------------------------------------------------------------------------

def test_names():
    assert moecl.preset_names() == NAMES
    for name in NAMES:
        e, k = shape(name)
        assert 1 <= k <= e
    with pytest.raises(moecl.InvalidArgumentError) as info:
        moecl.preset("DeepSeek-V3")
    for name in NAMES:  # the message lists every name
        assert name in str(info.value)
    with pytest.raises(moecl.InvalidArgumentError):
        moecl.preset_shape("deepseek")
    with pytest.raises(TypeError):
        moecl.preset(None)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("name", NAMES)
def test_random(ctx, rng, name, dtype):
    """Standard normal logits times 2 (bf16: rounded, which makes exact ties
    of equal logits common: the lower index takes them, on both sides)."""
    e, _ = shape(name)
    x32 = (rng.standard_normal((24, e)) * 2).astype(np.float32)
    bias32 = bias_for(name, rng, e)
    w, ids, x = run(ctx, name, x32, bias32, dtype)
    check(name, w, ids, x, bias32, False, "random " + dtype)


@pytest.mark.parametrize("name", NAMES)
def test_exact_ties(ctx, rng, name):
    """Rows whose values repeat exactly: all equal, a few values each many
    times, the k-th choice inside a run of equals. Equal logits give
    bit-equal scores on every device; the lower index goes first."""
    e, k = shape(name)
    rows = [np.zeros(e), np.repeat(np.arange(e // 4, dtype=np.float64), 4)[rng.permutation(e)] / 8,
            np.where(np.arange(e) % 3 == 0, 1.5, -0.5)]
    boundary = np.full(e, -1.0)
    boundary[rng.choice(e, k - 1 if k > 1 else 0, replace=False)] = 2.0
    boundary[rng.choice(np.flatnonzero(boundary < 0), 3, replace=False)] = 0.25
    rows.append(boundary)
    x32 = np.array(rows, np.float32)
    for zero in (True, False):
        bias32 = bias_for(name, rng, e, zero=zero)
        if bias32 is not None and not zero:
            bias32 = np.round(bias32 * 8) / 8  # few distinct values: biased ties too
        w, ids, x = run(ctx, name, x32, bias32)
        check(name, w, ids, x, bias32, True, "ties (bias %s)" % ("0" if zero else "steps"))


@pytest.mark.parametrize("name", NAMES)
def test_underflow(ctx, rng, name):
    """Very negative logits: softmax scores e^-150 and below, sigmoids of
    -110 and below, are exactly 0 in fp32 (not subnormal: no device's
    flushing changes them), so they tie and go by index. One expert per row
    stays large, so every row's chosen sum is positive."""
    e, k = shape(name)
    x32 = np.empty((4, e), np.float32)
    for t in range(4):
        x32[t] = -150.0 - rng.permutation(e).astype(np.float32) * 4  # distinct, all far below
        x32[t, rng.integers(e)] = 0.0
    bias32 = bias_for(name, rng, e, zero=True)
    w, ids, x = run(ctx, name, x32, bias32)
    check(name, w, ids, x, bias32, True, "underflow")


@pytest.mark.parametrize("name", sorted(SIGMOID_FAMILIES | {"deepseek-v4"}))
def test_all_chosen_underflow(ctx, rng, name):
    """Every score 0 in fp32: the chosen sum is 0, and sum + 1e-20 gives
    weights 0, as moecl's rule (a sum of 0 divides nothing) does. MiniMax-M2
    divides by the plain sum, 0/0 in the family's code: not covered (the
    preset gives 0, docs/routing.md section 10), so it is not run here."""
    if name == "minimax-m2":
        return
    e, _ = shape(name)
    x32 = np.full((2, e), -120.0 if name != "deepseek-v4" else -1e4, np.float32)
    x32[1] -= rng.permutation(e).astype(np.float32)
    bias32 = bias_for(name, rng, e)
    w, ids, x = run(ctx, name, x32, bias32)
    check(name, w, ids, x, bias32, True, "all underflow")
    assert (w == 0).all()


@pytest.mark.parametrize("name", sorted(EPS_FAMILIES))
def test_small_sum_epsilon(ctx, rng, name):
    """Chosen scores about 1e-20 (sigmoid of -45; sqrtsoftplus of -86: all
    normal fp32 numbers), so that the family's sum + 1e-20 moves the weights
    by several per cent from a division by the sum alone."""
    e, _ = shape(name)
    base = -45.0 if name != "deepseek-v4" else -86.0
    x32 = (base + rng.uniform(-1, 1, (6, e))).astype(np.float32)
    bias32 = bias_for(name, rng, e)
    w, ids, x = run(ctx, name, x32, bias32)
    check(name, w, ids, x, bias32, True, "small sum")


@pytest.mark.parametrize("name", NAMES)
def test_saturated(ctx, rng, name):
    """Large logits: sigmoids of 20 and more are exactly 1.0 in fp32 (1 +
    e^-20 rounds to 1), so distinct logits tie and go by index; with a bias
    the biased keys (1 + b) order them. Softmax rows with one logit 200
    above the rest: 1.0 there, exactly 0 elsewhere. Raw-logit families
    (Llama 4, GPT-OSS): TensorRT-LLM's Llama 4 example row, whose chosen
    sigmoid saturates to 1.0 after selection."""
    e, k = shape(name)
    x32 = np.empty((3, e), np.float32)
    x32[0] = 20.0 + rng.permutation(e).astype(np.float32) / 4
    x32[1] = rng.standard_normal(e).astype(np.float32)
    x32[1, rng.integers(e)] = 200.0
    x32[2] = -1.0
    x32[2, :8] = [20, 30, 17, 0, 1, 2, 25, -1]
    for zero in (True, False):
        bias32 = bias_for(name, rng, e, zero=zero)
        w, ids, x = run(ctx, name, x32, bias32)
        check(name, w, ids, x, bias32, True, "saturated (bias %s)" % ("0" if zero else "random"))


@pytest.mark.parametrize("name", NAMES)
def test_router_from_hidden_states(ctx, rng, name):
    """The same preset through Context.router from hidden states: g =
    hidden @ gate.T (fp32 products; hidden 64 wide here, not the
    checkpoint's), then the family's routing of g."""
    e, _ = shape(name)
    h = rng.standard_normal((8, 64)).astype(np.float32)
    gate = (rng.standard_normal((e, 64)) * 0.25).astype(np.float32)
    bias32 = bias_for(name, rng, e)
    w, ids = ctx.router(h, gate, bias=bias32, **moecl.preset(name))
    g = h.astype(np.float64) @ gate.astype(np.float64).T
    n = h.shape[1] + 2  # section 3's bound of an fp32 dot product
    g_err = n * ref.U / (1 - n * ref.U) * (np.abs(h.astype(np.float64)) @ np.abs(gate.astype(np.float64)).T)
    check(name, w, ids, g, bias32, False, "router", g_err)
