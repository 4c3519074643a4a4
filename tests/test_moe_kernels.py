"""The mixture-of-experts kernels (csrc/moe.h, behind kernels/interface.py moe_route / moe_experts) against
layers/moe.py: the fused router against route() on random logits full of ties and equal group scores, every routing
rule; the grouped expert GEMM against experts_reference in fp32 from the same bf16 weights, and against the
per-expert loop in bf16 (it rounds where that loop rounds); int8 / int4 experts against the per-expert loop of their
own methods and against their dequantized weights; a tiny Qwen3-MoE engine with the kernels against the engine on
torch's operators, and on the pure-PyTorch implementation of the contract. Each oracle runs on the AVX-512 library
(AMX where present) and on the AVX2 one, each where this CPU can run it."""

from __future__ import annotations

import ctypes
import zlib

import pytest
import torch

from infertune.config import MoeArch
from infertune.kernels import cpu, x86
from infertune.kernels.interface import KernelExperts, KernelLinear, MoeRouting
from infertune.layers.moe import Experts, experts_reference, group_by_expert, route


@pytest.fixture(params=["avx512", "avx2"])
def ks(request):
    if request.param == "avx512":
        if cpu.variant() not in ("avx512", "avx512-noamx"):
            pytest.skip(f"the AVX-512 kernels are not this process's: {cpu.describe()}")
        return x86.kernels()
    lib = cpu.load_variant("avx2")
    if isinstance(lib, str):
        pytest.skip(lib)
    return x86.Avx2Kernels(lib)


def moe_arch(e: int, k: int, **kw) -> MoeArch:
    return MoeArch(num_experts=e, top_k=k, intermediate_size=32, layers=(0,), **kw)


# Every rule of MoeArch, at the sizes of the families that use it (DeepSeek-V2's 160 experts scaled to 64).
RULES = {
    "softmax-raw": moe_arch(64, 8, norm_topk_prob=False),  # Qwen2-MoE, Qwen3-MoE with norm_topk_prob off
    "softmax-renormalised": moe_arch(64, 8, norm_topk_prob=True),  # Qwen3-MoE
    "mixtral": moe_arch(8, 2, norm_topk_prob=True),
    "v2-greedy-scaled": moe_arch(64, 6, norm_topk_prob=False, routed_scaling_factor=1.5),
    "v2-groups": moe_arch(
        64,
        6,
        norm_topk_prob=False,
        topk_method="group_limited_greedy",
        n_group=8,
        topk_group=3,
        routed_scaling_factor=16.0,
    ),
    "v3": moe_arch(
        256,
        8,
        norm_topk_prob=True,
        scoring="sigmoid",
        topk_method="noaux_tc",
        n_group=8,
        topk_group=4,
        routed_scaling_factor=2.5,
        correction_bias=True,
    ),
    "v3-one-group": moe_arch(
        32,
        4,
        norm_topk_prob=True,
        scoring="sigmoid",
        topk_method="noaux_tc",
        n_group=4,
        topk_group=1,
        correction_bias=True,
    ),
    "sigmoid-greedy-bias": moe_arch(32, 4, norm_topk_prob=True, scoring="sigmoid", correction_bias=True),
}


def router_inputs(moe: MoeArch, kind: str, t: int, g: torch.Generator):
    """Logits [T, E] and a correction bias (or None): fp32 normal, bf16 normal (the router's output in a bf16
    model), a grid of 13 values (ties everywhere, at the boundary too), and equal groups (group 1 a permutation of
    group 0, its bias permuted alike, the two lifted to the top: equal group scores, every expert tied with one in
    the other group; without groups, the two halves of the experts)."""
    e = moe.num_experts
    bias = 0.05 * torch.randn(e, generator=g) if moe.correction_bias else None
    if kind == "grid":  # (a bias of 5 values: equal logits and bias, equal choice)
        bias = torch.randint(-2, 3, (e,), generator=g) / 64.0 if moe.correction_bias else None
        return torch.randint(-6, 7, (t, e), generator=g) / 4.0, bias
    logits = torch.randn(t, e, generator=g)
    if kind == "bf16":
        return logits.bfloat16(), bias
    if kind == "equal-groups":
        size = e // (moe.n_group if moe.n_group > 1 else 2)
        perm = torch.randperm(size, generator=g)
        logits[:, :size] += 6.0
        logits[:, size : 2 * size] = logits[:, :size][:, perm]
        if bias is not None:  # (a sigmoid saturates: the bias lifts them too)
            bias[:size] += 0.5
            bias[size : 2 * size] = bias[:size][perm]
    return logits, bias


def choice_and_boundary_ties(logits, moe: MoeArch, bias):
    """The values route() ranks (scores + bias, dropped groups masked) and, per row, whether a tie at the boundary
    (the k-th best expert equal to the next, or the topk_group-th best group equal to the next) or a NaN decides the
    row's experts. An independent statement of where the tie rule matters (by sorted values, not by topk)."""
    scores = logits.float().softmax(-1) if moe.scoring == "softmax" else logits.float().sigmoid()
    choice = scores if bias is None else scores + bias
    t, e = choice.shape
    tied = choice.isnan().any(-1)
    if moe.topk_method != "greedy" and moe.n_group > 1:
        grouped = choice.view(t, moe.n_group, -1)
        gscore = grouped.topk(2, -1).values.sum(-1) if moe.topk_method == "noaux_tc" else grouped.amax(-1)
        ranked = gscore.sort(-1, descending=True)
        if moe.topk_group < moe.n_group:
            tied |= ranked.values[:, moe.topk_group - 1] == ranked.values[:, moe.topk_group]
        # (the groups kept: torch.topk's, whose pick among tied groups route() and the kernels take)
        keep = torch.zeros_like(gscore, dtype=torch.bool).scatter_(1, gscore.topk(moe.topk_group, -1).indices, True)
        fill = float("-inf") if moe.topk_method == "noaux_tc" else 0.0
        choice = choice.masked_fill(~keep.repeat_interleave(e // moe.n_group, dim=1), fill)
    best = choice.sort(-1, descending=True).values
    if moe.top_k < e:
        tied |= best[:, moe.top_k - 1] == best[:, moe.top_k]
    return choice, tied


def check_routing(got: MoeRouting, logits, moe: MoeArch, bias) -> None:
    """The kernel's routing of rows it answered: route()'s experts, each with its weight (within 1e-6); route()'s order
    where no two of a row's picks tie, the lower index first among those that do; the grouping of its ids."""
    weights, ids = route(logits, moe, bias)
    choice, _ = choice_and_boundary_ties(logits, moe, bias)
    mine, ref = got.ids.sort(dim=1), ids.sort(dim=1)
    assert torch.equal(mine.values, ref.values)
    # (within 1e-6 before the routed_scaling_factor: the scores' exp and sums agree to an ulp or two)
    tol = 1e-6 * max(1.0, moe.routed_scaling_factor)
    torch.testing.assert_close(got.weights.gather(1, mine.indices), weights.gather(1, ref.indices), atol=tol, rtol=0)
    picked = choice.gather(1, got.ids)  # best first; among equal values the lower index first
    assert (picked[:, :-1] >= picked[:, 1:]).all()
    assert ((picked[:, :-1] > picked[:, 1:]) | (got.ids[:, :-1] < got.ids[:, 1:])).all()
    distinct = (picked[:, :-1] != picked[:, 1:]).all(dim=1)
    assert torch.equal(got.ids[distinct], ids[distinct])
    order, counts = group_by_expert(got.ids, moe.num_experts)
    assert torch.equal(got.order, order) and torch.equal(got.counts, counts)


def hand_back_ties(monkeypatch) -> None:
    """The rule the kernels' router takes where this torch's topk picks otherwise among ties (kernels/cpu.py
    torch_topk_ties false): rows with a tie at the boundary go back to route()."""
    monkeypatch.setattr(cpu, "torch_topk_ties", lambda lib=None: False)


def test_the_tie_rule_is_torch_topks(ks):
    """moe_topk_torch (csrc/moe.h: libstdc++'s nth_element step for step) picks torch.topk's k of rows full of ties,
    NaN included, at sizes beside the load-time check's; at k * 64 <= n (topk's heap path) it says nothing."""
    lib = ks.lib
    assert cpu.torch_topk_ties(lib)
    g = torch.Generator().manual_seed(7)
    decided = 0
    for n, k in [(64, 8), (256, 8), (8, 2), (60, 4), (100, 7), (3, 3), (1000, 20), (48, 1)]:
        for levels in (1, 2, 3, 5, 1000):
            v = torch.randint(0, levels, (200, n), generator=g).float()
            v[::9, n // 2] = float("nan")
            taken, unsaid = cpu.moe_topk_torch(v, k, lib=lib)
            want = torch.zeros_like(taken).scatter_(1, v.topk(k, dim=-1).indices, True)
            assert unsaid == 0 and torch.equal(taken, want), (n, k, levels)
            decided += v.shape[0]
    taken, unsaid = cpu.moe_topk_torch(torch.zeros(5, 64), 1, lib=lib)
    assert unsaid == 5 and not taken.any()
    assert decided == 40 * 200


@pytest.mark.parametrize("ties", ["torch", "hand-back"])
@pytest.mark.parametrize("name", list(RULES))
@pytest.mark.parametrize("kind", ["normal", "bf16", "grid", "equal-groups"])
def test_fused_router_matches_route(ks, name, kind, ties, monkeypatch):
    """Row by row (where ties inside the top-k are common) and a whole batch (threaded past 4096 scores): the
    kernel's picks are route()'s, boundary ties included, settled as torch.topk settles them; with ties="hand-back"
    (where this torch's topk picks otherwise) it answers exactly where no row has a boundary tie."""
    if ties == "hand-back":
        hand_back_ties(monkeypatch)
    moe = RULES[name]
    g = torch.Generator().manual_seed(zlib.crc32(f"{name} {kind}".encode()))
    logits, bias = router_inputs(moe, kind, 96, g)
    choice, tied = choice_and_boundary_ties(logits, moe, bias)
    answers = tied if ties == "hand-back" else torch.zeros_like(tied)  # (the rows handed back)
    answered = inside_ties = 0
    for r in range(logits.shape[0]):
        got = ks.moe_route(logits[r : r + 1], moe, bias)
        assert (got is None) == bool(answers[r]), (r, logits[r])
        if got is not None:
            check_routing(got, logits[r : r + 1], moe, bias)
            answered += 1
            inside_ties += len(set(choice[r, got.ids[0]].tolist())) < moe.top_k
    for rows in (slice(0, 96), slice(None, None, 2)):  # (a strided batch too)
        got = ks.moe_route(logits[rows], moe, bias)
        assert (got is None) == bool(answers[rows].any())
        clear = ~answers
        if got is None and clear.sum() > 0:
            got = ks.moe_route(logits[clear], moe, bias)
            logits_checked = logits[clear]
        else:
            logits_checked = logits[rows]
        if got is not None:
            check_routing(got, logits_checked, moe, bias)
    # what each input is for: the grid, ties inside the top-k and at the boundary; equal groups, pairs of tied
    # experts inside the top-k (k is even), and the two best groups tied: kept together where more than one group is
    # kept, a boundary tie on every row where one is
    if kind == "grid":
        assert inside_ties > 0 and tied.any()
    if kind == "equal-groups" and moe.topk_method != "greedy" and moe.topk_group == 1:
        assert tied.all() and answered == (0 if ties == "hand-back" else logits.shape[0])
    elif kind == "equal-groups":
        assert not tied.any() and inside_ties == answered == logits.shape[0]
    else:
        assert answered > 0


@pytest.mark.parametrize("name", list(RULES))
def test_fused_router_takes_route_for_the_tied_rows_only(ks, name, monkeypatch):
    """Where ties go back to route() (the rule for a torch whose topk picks otherwise), with `tied` given (route() for
    some rows, as layers/moe.py Router passes it), a batch with boundary ties is answered whole: route() sees only the
    rows a boundary tie decides (the independent statement's), those rows carry its weights and ids bit for bit, the
    others the kernel's (route()'s experts, weights within 1e-6), and the grouping is that of the merged ids. (The
    fused step's hand-back merges the same way: its test against the modules, ties "some".) With torch's rule the
    kernel answers every row itself: `tied` is never called, and the picks are route()'s."""
    moe = RULES[name]
    g = torch.Generator().manual_seed(zlib.crc32(f"{name} tied rows".encode()))
    logits, bias = router_inputs(moe, "grid", 96, g)
    _, tied = choice_and_boundary_ties(logits, moe, bias)
    assert tied.any() and (~tied).any()
    seen = []

    def fallback(rows):
        seen.append(rows.shape[0])
        return route(rows, moe, bias)

    got = ks.moe_route(logits, moe, bias, tied=fallback)
    assert got is not None and seen == []
    check_routing(got, logits, moe, bias)
    hand_back_ties(monkeypatch)
    assert ks.moe_route(logits, moe, bias) is None  # (without it, a tie still hands the whole call back)
    got = ks.moe_route(logits, moe, bias, tied=fallback)
    assert got is not None and seen == [int(tied.sum())]
    weights, ids = route(logits[tied], moe, bias)
    assert torch.equal(got.weights[tied], weights) and torch.equal(got.ids[tied], ids)
    clear = MoeRouting(got.weights[~tied], got.ids[~tied], *group_by_expert(got.ids[~tied], moe.num_experts))
    check_routing(clear, logits[~tied], moe, bias)
    order, counts = group_by_expert(got.ids, moe.num_experts)
    assert torch.equal(got.order, order) and torch.equal(got.counts, counts)


def test_router_kernel_hands_back_nan_and_refuses_what_it_does_not_fit(ks):
    moe = RULES["softmax-renormalised"]
    logits = torch.randn(3, 64)
    logits[1, 7] = float("nan")
    assert ks.moe_route(logits, moe) is None  # route() decides what a NaN router does
    assert ks.moe_route(torch.randn(3, 32), moe) is None  # not this rule's experts
    assert ks.moe_route(torch.randn(3, 64, dtype=torch.float64), moe) is None
    assert ks.moe_route(torch.randn(64, 3).t(), moe) is None  # columns strided


# ---- the grouped expert GEMM -------------------------------------------------------------------------------


def expert_weights(e: int, hidden: int, inter: int, g: torch.Generator):
    gate_up = (torch.randn(e, 2 * inter, hidden, generator=g) / hidden**0.5).bfloat16()
    down = (torch.randn(e, hidden, inter, generator=g) / inter**0.5).bfloat16()
    return gate_up, down


def bf16_experts(gate_up, down) -> KernelExperts:
    e, two_i, hidden = gate_up.shape
    return KernelExperts(
        e, KernelLinear("bf16", two_i, hidden, weight=gate_up), KernelLinear("bf16", hidden, two_i // 2, weight=down)
    )


def reference_routing(t: int, e: int, k: int, g: torch.Generator, unpicked: int, hot: int | None) -> MoeRouting:
    """route()'s routing of random logits where the last `unpicked` experts never win and expert `hot` (if any)
    is in every token's top-k."""
    logits = torch.randn(t, e, generator=g)
    logits[:, e - unpicked :] = -30.0
    if hot is not None:
        logits[:, hot] = 30.0
    weights, ids = route(logits, moe_arch(e, k, norm_topk_prob=True))
    return MoeRouting(weights, ids, *group_by_expert(ids, e))


# (tokens, the expert every token picks or None, top_k): at top-1 with one expert picked, that expert's features are
# split over the threads; else the experts run side by side
@pytest.mark.parametrize(
    "t,hot,k", [(1, None, 4), (3, None, 4), (16, None, 4), (64, None, 4), (64, 5, 4), (1, None, 1), (20, 5, 1)]
)
@pytest.mark.parametrize("hidden,inter", [(256, 96), (200, 40)])  # AMX tiles / K not a multiple of 32, N tails
def test_grouped_experts_match_the_reference(ks, t, hot, k, hidden, inter):
    """Against experts_reference in fp32 on the same bf16 weights, within 2^-7 (the rtol of the linear kernels'
    tests; atol 2^-7 of the output's scale, for elements that cancel); against the per-expert loop in bf16 bit for
    bit in 98% of the elements or more (the same roundings: gate_up, SiLU-and-multiply, down, the weighted rows
    summed in fp32). Three experts are never picked (their weights are NaN: never read); one expert takes every token
    (64 rows: the tile GEMM with AMX), or at top-1 is the only one picked (its features split over the threads)."""
    e = 16
    g = torch.Generator().manual_seed(t * 1000 + hidden + k)
    gate_up, down = expert_weights(e, hidden, inter, g)
    gate_up[e - 3 :] = float("nan")
    down[e - 3 :] = float("nan")
    experts = bf16_experts(gate_up, down)
    x = torch.randn(t, hidden, generator=g).bfloat16()
    routing = reference_routing(t, e, k, g, unpicked=3, hot=hot)
    assert routing.counts[e - 3 :].sum() == 0 and (hot is None or routing.counts[hot] == t)
    y = ks.moe_experts(x, experts, routing)
    assert y is not None and y.dtype is torch.bfloat16 and y.shape == (t, hidden)
    ref = experts_reference(x.float(), gate_up.float(), down.float(), routing.weights, routing.ids)
    assert ref.isfinite().all() and y.isfinite().all()
    torch.testing.assert_close(y.float(), ref, rtol=2**-7, atol=2**-7 * float(ref.abs().max()))
    loop = experts_reference(x, gate_up, down, routing.weights, routing.ids)
    # (a GEMM of its own fp32 order differs from torch's by one bf16 step now and then; rounding anywhere else
    # than the loop does, e.g. the weighted sum in bf16, leaves about half the elements equal)
    assert (y == loop).float().mean() >= 0.98
    torch.testing.assert_close(y.float(), loop.float(), rtol=2**-7, atol=2**-8 * float(ref.abs().max()))


@pytest.mark.parametrize("t", [1, 5])
def test_a_block_of_the_experts_runs_its_part_of_the_sum(ks, t):
    """Expert parallel: KernelExperts holding experts first .. first + local - 1 of the router's 16 (first / total)
    give, for the router's routing, the per-expert loop over the same pairs with every other expert's weight zero
    (its pairs then add nothing), bit for bit in 98% of the elements or more as the whole layer does; a token none of
    whose experts is in the block gets zeros; and the blocks' parts add up to the whole layer's output."""
    import dataclasses

    e, k, hidden, inter = 16, 4, 64, 32
    g = torch.Generator().manual_seed(40 + t)
    gate_up, down = expert_weights(e, hidden, inter, g)
    x = torch.randn(t, hidden, generator=g).bfloat16()
    routing = reference_routing(t, e, k, g, unpicked=0, hot=None)
    routing = routing._replace(ids=routing.ids.clone())
    routing.ids[0] = torch.tensor([0, 1, 2, 3])  # token 0: experts 0-3 only (none in the second block)
    routing = MoeRouting(routing.weights, routing.ids, *group_by_expert(routing.ids, e))
    whole = ks.moe_experts(x, bf16_experts(gate_up, down), routing)
    parts = []
    for first, local in ((0, 8), (8, 8)):
        block = dataclasses.replace(
            bf16_experts(gate_up[first : first + local], down[first : first + local]), first=first, total=e
        )
        y = ks.moe_experts(x, block, routing)
        assert y is not None and y.shape == (t, hidden)
        inside = (routing.ids >= first) & (routing.ids < first + local)
        loop = experts_reference(x, gate_up, down, routing.weights * inside, routing.ids)
        assert (y == loop).float().mean() >= 0.98
        torch.testing.assert_close(y.float(), loop.float(), rtol=2**-7, atol=2**-8 * float(loop.abs().max()))
        parts.append(y.float())
    assert (parts[1][0] == 0).all()  # token 0's experts are all in the first block
    torch.testing.assert_close(parts[0] + parts[1], whole.float(), rtol=2**-6, atol=2**-6 * float(whole.abs().max()))


def test_grouped_experts_refuse_what_they_do_not_fit(ks):
    g = torch.Generator().manual_seed(2)
    gate_up, down = expert_weights(8, 64, 32, g)
    routing = reference_routing(4, 8, 2, g, unpicked=0, hot=None)
    x = torch.randn(4, 64, generator=g).bfloat16()
    transposed = KernelExperts(8, bf16_experts(gate_up, down).gate_up, KernelLinear("bf16", 64, 32, weight=down.mT))
    assert ks.moe_experts(x, transposed, routing) is None  # not contiguous [E, N, K]
    too_many = torch.randn(ks.max_rows("bf16") * 4 + 1, 64).bfloat16()  # more rows per expert than the linears take
    wide = reference_routing(too_many.shape[0], 8, 2, g, unpicked=0, hot=None)
    assert ks.moe_experts(too_many, bf16_experts(gate_up, down), wide) is None
    # a grouping that is not one of these rows is an error, never read past
    twice = routing.order.clone()
    twice[1] = twice[0]
    for bad in (routing._replace(order=twice), routing._replace(counts=routing.counts + 1)):
        with pytest.raises(ValueError, match="it_moe_experts refused"):
            ks.moe_experts(x, bf16_experts(gate_up, down), bad)


def quantized_experts(ks, method: str, group_size: int, e: int, k: int, hidden: int, inter: int, g):
    """An Experts layer of random bf16 weights quantized (quant/experts.py: "w8a16", "w8a8", or "w4a16" in groups of
    group_size), and its KernelExperts."""
    from infertune.quant.experts import QuantizedExperts
    from infertune.quant.int4 import W4A16Method
    from infertune.quant.int8 import W8A8Method, W8A16Method

    if method == "w8a8" and not cpu.w8a8_supported(ks.lib):
        pytest.skip(f"{ks.name}: no int8 x int8 kernel")

    layer = Experts(hidden, MoeArch(e, k, inter, layers=(0,), norm_topk_prob=True), torch.bfloat16)
    gate_up, down = expert_weights(e, hidden, inter, g)
    with torch.no_grad():
        layer.gate_up_proj.copy_(gate_up)
        layer.down_proj.copy_(down)
    if method == "w8a16":
        layer.quant_method = QuantizedExperts(lambda: W8A16Method(kernels=ks))
    elif method == "w8a8":
        layer.quant_method = QuantizedExperts(lambda: W8A8Method(kernels=ks))
    else:
        layer.quant_method = QuantizedExperts(lambda: W4A16Method(group_size=group_size, kernels=ks))
    layer.quant_method.process_weights_after_loading(layer)
    experts = layer.quant_method.kernel_experts(layer)
    # (W8A16 / W4A16 experts keep the packed layouts where the kernels take them: AVX-512; W4A16's for MoE models)
    packed4 = ks.max_rows("w4p", moe=True) > 0
    want = {"w8a16": "w8p" if ks.max_rows("w8p") > 0 else "w8", "w4a16": "w4p" if packed4 else "w4"}
    assert experts is not None and experts.gate_up.kind == want.get(method, method)
    return layer, experts


@pytest.mark.parametrize("method", ["w8a16", "w4a16", "w8a8"])
@pytest.mark.parametrize("t", [1, 5, 40, 150])
def test_quantized_experts_match_their_per_expert_loop(ks, method, t):
    """Int8 / int4 experts (quant/experts.py: the Linear methods' buffers stacked over the experts) through the
    grouped kernel: the same int kernels as the per-expert loop runs on each expert's slice (bit for bit almost
    everywhere; past 16 rows an expert's loop multiplies its dequantized weight with torch's GEMM; W8A8, and W8A16 /
    W4A16 on their packed layouts (AVX-512; with AMX W4A16's past 16 rows on the tiles and W8A16's past
    it_w8p_tile_rows, lowered here, their gate_up writing SiLU-and-multiply in the epilogue: 150 tokens put ~37 rows on
    an expert), bit for bit everywhere: their kernels
    take any row count),
    and within 2^-7 of experts_reference in fp32 on the dequantized weights (2^-5 with W8A8's int8 activations)."""
    e, k, hidden, inter = 8, 2, 128, 64
    g = torch.Generator().manual_seed(t)
    layer, experts = quantized_experts(ks, method, 64, e, k, hidden, inter, g)
    x = torch.randn(t, hidden, generator=g).bfloat16()
    routing = reference_routing(t, e, k, g, unpicked=1, hot=None)
    y = ks.moe_experts(x, experts, routing)
    if t * k > 16 * e and experts.gate_up.kind in ("w8", "w4"):  # (the row layouts: up to 16 rows an expert)
        assert y is None
        return
    assert y is not None
    loop = layer.forward_native(x, routing)
    assert (y == loop).float().mean() >= 0.99
    if experts.gate_up.kind in ("w8a8", "w8p", "w4p"):
        assert torch.equal(y.view(torch.int16), loop.view(torch.int16))
    if experts.gate_up.kind == "w8p" and getattr(ks, "amx", False) and t * k > 16 * e:
        # (W8A16's tiles past it_w8p_tile_rows rows an expert, here ~37: the grouped kernel and the loop alike)
        lib, rows = cpu.library(), cpu.library().it_w8p_tile_rows(0)
        lib.it_w8p_tile_rows(16)
        try:
            y_tiles, loop_tiles = ks.moe_experts(x, experts, routing), layer.forward_native(x, routing)
        finally:
            lib.it_w8p_tile_rows(rows)
        assert torch.equal(y_tiles.view(torch.int16), loop_tiles.view(torch.int16))
        assert not torch.equal(y_tiles, y)  # (the bf16 weights' products, not the integers')
        ref = experts_reference(
            x.float(),
            layer.quant_method.dequantized_weight(layer, "gate_up_proj").float(),
            layer.quant_method.dequantized_weight(layer, "down_proj").float(),
            routing.weights,
            routing.ids,
        )
        torch.testing.assert_close(y_tiles.float(), ref, rtol=2**-7, atol=2**-7 * float(ref.abs().max()))
    dq_gate_up = layer.quant_method.dequantized_weight(layer, "gate_up_proj")
    dq_down = layer.quant_method.dequantized_weight(layer, "down_proj")
    ref = experts_reference(x.float(), dq_gate_up.float(), dq_down.float(), routing.weights, routing.ids)
    tol = 2**-5 if method == "w8a8" else 2**-7
    torch.testing.assert_close(y.float(), ref, rtol=tol, atol=tol * float(ref.abs().max()))


@pytest.mark.parametrize("method", ["w8a16", "w4a16"])
@pytest.mark.parametrize("t,overlap", [(1, False), (3, False), (3, True)])
@pytest.mark.parametrize("layout", ["rows", "own"])
def test_quantized_experts_of_one_row_each_are_their_per_expert_loop_bit_for_bit(
    ks, method, t, overlap, layout, monkeypatch
):
    """Int8 experts, or int4 ones in groups of 128, on their row layouts ([N, K] int8, pack_w4's rows: what AMX
    machines keep; forced here with layout "rows"), where every expert picked holds one row (a decode step's token, or
    tokens that picked different experts) take the AVX-512 library's one-row path (moe.c moe_one_row: each token's
    row rounded to int16 once, the experts' rows as one stack of row blocks split over the threads): bit for bit the
    per-expert loop over linear_w8 / linear_w4 (Experts.forward_native) at one row an expert. With an expert shared
    by the tokens (three rows for it) the per-expert path runs, bit for bit the loop too. On the layouts the kernels
    keep ("own": the packed W8A16 and W4A16) the per-expert path runs the packed kernels, bit for bit the
    loop as well. (int8: hidden 328, the rows padded to 384 inside the kernel.)"""
    if layout == "rows":  # (the kernels offer no packed kind: the methods keep the row layouts)
        offered = ks.max_rows
        monkeypatch.setattr(ks, "max_rows", lambda kind, **kw: 0 if kind in ("w8p", "w4p") else offered(kind, **kw))
    elif ks.max_rows("w8p" if method == "w8a16" else "w4p", moe=True) <= 0:
        pytest.skip(f"{ks.name}: no packed {method} here (the rows case is this CPU's layout)")
    e, k, hidden, inter = 16, 4, 384 if method == "w4a16" else 328, 256
    g = torch.Generator().manual_seed(70 + t)
    layer, experts = quantized_experts(ks, method, 128, e, k, hidden, inter, g)
    assert experts.gate_up.kind in ({"w8", "w4"} if layout == "rows" else {"w8p", "w4p"})
    # token i prefers experts 4i .. 4i + 3 (distinct across tokens), or with overlap expert 15 too
    logits = torch.randn(t, e, generator=g)
    for i in range(t):
        logits[i, 4 * i : 4 * i + 4] += 20.0
        if overlap:
            logits[i, 15] += 40.0
    weights, ids = route(logits, moe_arch(e, k, norm_topk_prob=True))
    routing = MoeRouting(weights, ids, *group_by_expert(ids, e))
    assert int(routing.counts.max()) == (t if overlap else 1)
    for scale in (1.0, 1e-3, 300.0):  # the activations' int16 scale per token
        x = (torch.randn(t, hidden, generator=g) * scale).bfloat16()
        y = ks.moe_experts(x, experts, routing)
        loop = layer.forward_native(x, routing)
        assert torch.equal(y.view(torch.int16), loop.view(torch.int16)), (scale, (y != loop).sum())


needs_bf16c = pytest.mark.skipif(
    not (cpu.available() and cpu.bf16c_supported(16, 32)),
    reason=f"the 12-bit layout needs the AVX-512 library (with or without AMX): {cpu.describe()}",
)


@needs_bf16c
@pytest.mark.parametrize("t, hidden", [(1, 128), (3, 128), (16, 128), (40, 128), (250, 128), (120, 4096)])
def test_12bit_experts_are_the_bf16_experts_bit_for_bit(t, hidden):
    """Each expert's projections in the lossless 12-bit layout (the gate_up packed for SiLU in its epilogue, so the
    grouped kernel takes act straight from it): the grouped experts give the bf16 experts' output bit for bit, at 1
    to 250 tokens (40 x top-4 over 7 experts: experts past 16 rows; 250: ~140 rows each, a prefill's, each expert's
    rows in one GEMM; hidden 4096 at 120 tokens: the AMX GEMM cuts gate_up's K into slabs, its sums kept between
    them in the scratch). Without AMX the bf16
    experts take the VDPBF16PS GEMM at every row count (it_gemm_rows_noamx(1)), whose sums the 12-bit register path
    makes; weights with rare high bytes make escapes in most tiles, and an expert no token picks is NaN."""
    ks = x86.kernels()
    lib = cpu.library()
    e, k, inter = 8, 4, 96
    gen = torch.Generator().manual_seed(7 + t)
    gate_up = (torch.randn(e, 2 * inter, hidden, generator=gen) * 0.05).bfloat16()
    down = (torch.randn(e, hidden, inter, generator=gen) * 0.05).bfloat16()
    for w in (gate_up, down):  # a few tiny weights far below the common exponents, each rare: escapes
        flat = w.view(-1)
        n = flat.numel() // 100
        flat[torch.randint(0, flat.numel(), (n,), generator=gen)] = torch.ldexp(
            torch.ones(n), -torch.randint(20, 110, (n,), generator=gen)
        ).bfloat16()
    x = torch.randn(t, hidden, generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(e - 1, generator=gen)[:k] for _ in range(t)])  # expert e - 1: nobody's
    gate_up[e - 1] = down[e - 1] = float("nan")
    routing = MoeRouting(torch.rand(t, k, generator=gen), ids, *group_by_expert(ids, e))
    plain = KernelExperts(
        e, KernelLinear("bf16", 2 * inter, hidden, weight=gate_up), KernelLinear("bf16", hidden, inter, weight=down)
    )
    packed = {name: [ks.compress(w[i], gate_up=name == "gate_up") for i in range(e)] for name, w in
              (("gate_up", gate_up), ("down", down))}  # fmt: skip
    assert (
        all(cw.inter == inter for cw in packed["gate_up"])
        and sum(int(cw.buffers["esc_pos"].numel()) for cw in packed["gate_up"]) > e * 15
    )
    compressed = KernelExperts(
        e,
        KernelLinear("bf16c", 2 * inter, hidden, compressed_experts=tuple(packed["gate_up"])),
        KernelLinear("bf16c", hidden, inter, compressed_experts=tuple(packed["down"])),
    )
    old = lib.it_gemm_rows_noamx(0)  # (0: only read it)
    lib.it_gemm_rows_noamx(1)
    try:
        want = ks.moe_experts(x, plain, routing)
        got = ks.moe_experts(x, compressed, routing)
    finally:
        lib.it_gemm_rows_noamx(old)
    assert want is not None and got is not None and not want.isnan().any()
    assert torch.equal(got, want)


@needs_bf16c
def test_engine_with_12bit_experts_is_the_engine_with_bf16_experts(tmp_path, monkeypatch):
    """compress_weights="auto" keeps a MoE model's experts in the 12-bit layout too (CompressedExperts: 0.76x the
    bytes); with the bf16 linears on the VDPBF16PS GEMM at every row count (as above), the engine's tokens and
    logprobs are compress_weights="off"'s bit for bit, through the fused decode step and through the per-module
    forward, and no expert is ever unpacked."""
    from conftest import make_checkpoint

    from infertune import LLM, SamplingParams
    from infertune.layers.moe import CompressedExperts

    path = make_checkpoint(tmp_path / "m", **TINY_MOE)
    lib = cpu.library()
    dense_calls = []
    real_dense = x86.Bf16cWeight.dense
    monkeypatch.setattr(x86.Bf16cWeight, "dense", lambda self: dense_calls.append(1) or real_dense(self))
    gen = torch.Generator().manual_seed(4)
    prompts = [{"prompt_token_ids": torch.randint(3, 250, (n,), generator=gen).tolist()} for n in (4, 9, 21, 3)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2)
    runs, old = {}, lib.it_gemm_rows_noamx(0)  # (0: only read it)
    lib.it_gemm_rows_noamx(1)
    try:
        for compress, kernel_mode in (("auto", "auto"), ("auto", "linear"), ("off", "auto"), ("off", "linear")):
            llm = LLM(
                str(path),
                dtype="bfloat16",
                compress_weights=compress,
                decode_kernels=kernel_mode,
                max_model_len=96,
                block_size=16,
            )
            runner = llm.engine.executor.runner
            experts = [m for m in runner.model.modules() if isinstance(m, Experts)]
            assert all(isinstance(m.quant_method, CompressedExperts) == (compress == "auto") for m in experts)
            assert (runner.fused is not None) == (kernel_mode == "auto")
            runs[compress, kernel_mode] = [
                (o.outputs[0].token_ids, [(lp.token_id, lp.logprob) for lp in o.outputs[0].logprobs])
                for o in llm.generate(prompts, params, use_tqdm=False)
            ]
            if compress == "auto":
                size = sum(b.numel() * b.element_size() for m in experts for b in m.buffers())
                assert size < 0.8 * sum(m.num_experts for m in experts) * 3 * 128 * 64 * 2  # (bf16: 2 bytes)
    finally:
        lib.it_gemm_rows_noamx(old)
    assert dense_calls == []
    assert runs["auto", "auto"] == runs["off", "auto"]
    assert runs["auto", "linear"] == runs["off", "linear"]


# ---- the engine ----------------------------------------------------------------------------------------------

TINY_MOE = dict(
    arch="qwen3_moe",
    hidden_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    num_experts=16,
    num_experts_per_tok=4,
    moe_intermediate_size=64,
    norm_topk_prob=True,
    dtype=torch.bfloat16,
)


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    from conftest import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("qwen3moe"), **TINY_MOE)


def _greedy(llm, prompts, max_tokens=12):
    from infertune import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=1)
    return llm.generate(prompts, params, use_tqdm=False), params


def _worst_logprob_errors(outs: dict, hf) -> dict:
    """Per engine (outs: {name: generate outputs with logprobs}), the largest |logprob - HF fp32's| of a picked
    token, HF teacher-forced on the prompt and the engine's own tokens."""
    worst = dict.fromkeys(outs, 0.0)
    for mode, results in outs.items():
        for out in results:
            ids = out.prompt_token_ids + out.outputs[0].token_ids
            with torch.no_grad():
                ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), dim=-1)
            p = len(out.prompt_token_ids)
            for j, lp in enumerate(out.outputs[0].logprobs):
                worst[mode] = max(worst[mode], abs(lp.logprob - ref[p - 1 + j, lp.token_id].item()))
    return worst


@pytest.mark.skipif(cpu.variant() not in ("avx512", "avx512-noamx"), reason=f"AVX-512 kernels: {cpu.describe()}")
def test_engine_with_moe_kernels_matches_the_engine_on_torch(tiny_moe, monkeypatch):
    """bf16 Qwen3-MoE, greedy, a batch of 5 (prefill rows and decode rows through the kernels). Per module (the fused
    step off): every experts call and every decode step's router call takes the kernels (a tie at the top-k boundary
    settled as torch.topk settles it) and the tokens are those of decode_kernels="off". With the fused step (the
    default) the prompt step and every decode step run in it, with AMX or without (its C attention rounds otherwise than torch's SDPA, so tokens may part from there: the
    layers' own exactness is test_fused_step_runs_moe_and_qk_norm_layers_as_the_modules_do). Every engine's logprobs
    are as close to HF transformers' in fp32 as the dense engine tests allow."""
    from conftest import hf_model

    from infertune import LLM
    from infertune.runner.fused_decode import FusedDecode

    calls = {"route": 0, "experts": 0}
    route_call, experts_call = x86.X86Kernels.moe_route, x86.X86Kernels.moe_experts

    def counting(key, fn):
        def wrapped(self, *args, **kw):
            out = fn(self, *args, **kw)
            calls[key] += out is not None
            return out

        return wrapped

    monkeypatch.setattr(x86.X86Kernels, "moe_route", counting("route", route_call))
    monkeypatch.setattr(x86.X86Kernels, "moe_experts", counting("experts", experts_call))
    gen = torch.Generator().manual_seed(4)
    prompts = [{"prompt_token_ids": torch.randint(3, 250, (n,), generator=gen).tolist()} for n in (4, 9, 21, 3, 40)]
    outs = {}
    build = FusedDecode.build
    for mode in ("auto", "per-module", "off"):
        monkeypatch.setattr(FusedDecode, "build", (lambda *a, **k: None) if mode == "per-module" else build)
        llm = LLM(
            str(tiny_moe),
            dtype="bfloat16",
            decode_kernels="off" if mode == "off" else "auto",
            max_model_len=96,
            block_size=16,
        )
        fused = llm.engine.executor.runner.fused
        assert (fused is not None) == (mode == "auto")
        before = dict(calls)
        outs[mode] = _greedy(llm, prompts)[0]
        used = {key: calls[key] - before[key] for key in calls}
        amx = x86.kernels().max_rows("bf16") > 16
        if mode == "per-module":
            # an experts call per MoE layer and step: the 11 decode steps, and the prompt step where its 77 rows fit
            # the experts kernel (only with AMX's tile GEMM: without AMX the linears take at most 16 rows); a router
            # call per layer and decode step (the prompt's 77 rows take route(): ROUTER_KERNEL_ROWS), a boundary
            # tie's rows routed by route() inside it
            steps = (12 if amx else 11) * 3
            assert used["experts"] >= steps and used["route"] == 11 * 3, used
        elif mode == "auto":  # the decode steps in the fused step; the prompt step too where it takes its 77 rows
            prompt_fused = fused.decoder.max_prefill_rows >= 77  # (x86_fused.py moe_prompts: AMX or not)
            assert prompt_fused and fused.step_timers()["calls"] == 12 and used["route"] == 0, used
            assert fused.step_timers()["experts"] > 0 and (used["experts"] == 0 or not prompt_fused), used
        else:
            assert used == {"route": 0, "experts": 0}
        del llm
    assert [o.outputs[0].token_ids for o in outs["per-module"]] == [o.outputs[0].token_ids for o in outs["off"]]
    worst = _worst_logprob_errors(outs, hf_model(tiny_moe).float())
    assert max(worst["auto"], worst["per-module"]) <= 1.5 * worst["off"] + 0.02, worst


@pytest.mark.skipif(cpu.variant() not in ("avx512", "avx512-noamx"), reason=f"AVX-512 kernels: {cpu.describe()}")
@pytest.mark.parametrize("quant", ["w8a16", "w8a8", "w4a16"])
def test_quantized_moe_prompts_in_the_fused_step_are_as_accurate_as_per_module(tiny_moe, monkeypatch, quant):
    """A bf16 Qwen3-MoE with W8A16 (packed), W8A8 or W4A16 (packed) experts runs whole prompt steps in the fused
    step (on AMX the experts on the AMX-INT8 tiles, W4A16's on the bf16 tiles from its nibbles rebuilt chunk by chunk;
    without AMX their VNNI kernels; x86_fused.py moe_prompts): the prompt step of 77 rows goes through it, and the
    logprobs against HF transformers in fp32 (on the unquantized weights: both engines carry the same quantization
    error) are as close as those of the same engine with the fused step off (the modules on the kernels)."""
    from conftest import hf_model

    from infertune import LLM
    from infertune.runner.fused_decode import FusedDecode

    gen = torch.Generator().manual_seed(9)
    prompts = [{"prompt_token_ids": torch.randint(3, 250, (n,), generator=gen).tolist()} for n in (4, 9, 21, 3, 40)]
    build, outs = FusedDecode.build, {}
    for mode in ("auto", "per-module"):
        monkeypatch.setattr(FusedDecode, "build", (lambda *a, **k: None) if mode == "per-module" else build)
        llm = LLM(
            str(tiny_moe), dtype="bfloat16", max_model_len=96, block_size=16, quantization=quant, quant_group_size=64
        )
        fused = llm.engine.executor.runner.fused
        if mode == "auto":
            from infertune.layers.moe import Experts

            experts = [m for m in llm.engine.executor.runner.model.modules() if isinstance(m, Experts)]
            kinds = {m.kernel_view().gate_up.kind for m in experts}
            assert experts and kinds == {{"w8a16": "w8p", "w8a8": "w8a8", "w4a16": "w4p"}[quant]}, kinds
            assert fused is not None and fused.decoder.max_prefill_rows >= 77
        outs[mode] = _greedy(llm, prompts)[0]
        if mode == "auto":
            assert fused.step_timers()["calls"] == 12  # (the prompt step and the 11 decode steps)
        del llm
    worst = _worst_logprob_errors(outs, hf_model(tiny_moe).float())
    assert worst["auto"] <= 1.5 * worst["per-module"] + 0.02, worst


def _attention_free_checkpoint(tmp_path, arch: str, ties: str | None = None):
    """A tiny bf16 checkpoint of arch whose o_proj is zero (attention adds nothing to the residual stream: the fused
    step's C attention and torch's SDPA round differently, and nothing else may); ties "all": every router row the
    same (every token ties at the top-k boundary), "some": experts 0 and 1 the same (a token ties where the two
    straddle its boundary)."""
    from conftest import make_checkpoint
    from safetensors.torch import load_file, save_file

    shape = dict(hidden_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2)
    shape |= {
        "qwen3": dict(head_dim=32),
        "qwen3_moe": dict(head_dim=32, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=64),
        "qwen2_moe": dict(
            num_experts=16, num_experts_per_tok=4, moe_intermediate_size=64, shared_expert_intermediate_size=128
        ),
        "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=96),
    }[arch]
    path = make_checkpoint(tmp_path / arch, arch, dtype=torch.bfloat16, std=0.1 if arch == "qwen3" else 0.3, **shape)
    state = load_file(path / "model.safetensors")
    for name, t in state.items():
        if "o_proj" in name:
            state[name] = torch.zeros_like(t)
        if ties and name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):
            state[name] = t[:1].expand_as(t).contiguous() if ties == "all" else torch.cat([t[:1], t[:1], t[2:]])
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.mark.skipif(cpu.variant() not in ("avx512", "avx512-noamx"), reason=f"AVX-512 kernels: {cpu.describe()}")
def test_profile_counts_the_expert_load_of_the_fused_steps(tmp_path, monkeypatch):
    """`infertune profile` on a bf16 MoE model whose decode steps run in the fused step (routing in C, past the
    routers' hooks): the expert-load table still counts every row of every step, the same counts as with the fused
    step off (attention-free checkpoint: both paths pick the same experts), but for a prompt step in the fused step
    (AVX-512, AMX or not), whose last layer routes only the rows whose logits are taken; the steps' C timers show the
    experts and the router in every step (ties at the top-k boundary settled in C: no hand-back leaves the timers)."""
    from infertune import LLM, SamplingParams
    from infertune.profile.timeline import profile_workload
    from infertune.runner.fused_decode import FusedDecode

    path = _attention_free_checkpoint(tmp_path, "qwen3_moe")
    input_len, output_len, batch = 9, 5, 2
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    loads, build = {}, FusedDecode.build
    for fused in (True, False):
        monkeypatch.setattr(FusedDecode, "build", build if fused else (lambda *a, **k: None))
        llm = LLM(str(path), dtype="bfloat16", max_model_len=32, max_num_seqs=batch)
        assert (llm.engine.executor.runner.fused is not None) == fused
        result = profile_workload(llm, input_len, output_len, batch, params, warmup=False)
        loads[fused] = {name: list(counts) for name, counts in result.expert_load.items()}
        parts = [r.fused for r in result.records if r.fused is not None]
        if fused:  # (the decode steps; the prompt step too where the fused step takes prompts: AVX-512)
            prompt_fused = llm.engine.executor.runner.fused.decoder.max_prefill_rows >= input_len * batch
            assert len(parts) == output_len - 1 + prompt_fused and all(p["experts"] > 0 for p in parts)
            assert all(p["MoE router"] > 0 for p in parts)
            assert llm.engine.executor.runner.fused.decoder.step.expert_load is None  # counting left with profile
        else:
            assert parts == []
    assert len(loads[True]) == 3 and list(loads[True]) == list(loads[False])
    assert all(sum(c) == (input_len + output_len - 1) * batch * 4 for c in loads[False].values())
    last = list(loads[True])[-1]
    for name, counts in loads[True].items():
        if prompt_fused and name == last:  # (a fused prompt step's last layer runs only the rows whose logits count)
            assert sum(counts) == output_len * batch * 4
        else:
            assert counts == loads[False][name], name


@pytest.mark.skipif(cpu.variant() not in ("avx512", "avx512-noamx", "avx2"), reason=f"x86 kernels: {cpu.describe()}")
@pytest.mark.parametrize(
    "arch,quant,ties,rule",
    [
        ("qwen3", None, None, "torch"),  # q / k norms
        ("qwen3_moe", None, None, "torch"),
        ("qwen3_moe", None, "some", "torch"),
        ("qwen3_moe", None, "some", "hand-back"),
        ("qwen3_moe", "w8a16", "all", "torch"),
        ("qwen3_moe", "w8a16", "all", "hand-back"),
        ("qwen3_moe", "w8a8", None, "torch"),  # experts, attention and routers' inputs rounded to int8 per row
        ("qwen2_moe", "w4a16", "all", "hand-back"),  # the shared expert and its sigmoid gate
        ("mixtral", None, "all", "torch"),
    ],
)
def test_fused_step_runs_moe_and_qk_norm_layers_as_the_modules_do(tmp_path, monkeypatch, arch, quant, ties, rule):
    """The fused step's q / k norms and MoE layers (router, top-k, grouped experts, shared expert) against the same
    model's modules on the kernels, step by step, bit for bit. Attention is the one part the two paths round
    differently (the C attention against torch's SDPA), so the checkpoint's o_proj is zero: each layer's attention
    adds nothing, and every other part must then agree exactly, the hidden states and every K / V the step writes
    (the k norm's output). ties "all": every router row the same, so every token's experts tie at the top-k boundary;
    "some": two experts the same, so some tokens tie there. The step settles them as torch.topk does, in C, as the
    modules' router does (rule "torch"); where this torch's topk picks otherwise (rule "hand-back"), with "all" every
    MoE layer of every step is handed back to route() and resumed, with "some" some steps' layers hand back a few
    tied rows (route() picks theirs, the step's own picks stand for the others, in both paths)."""
    from infertune import LLM, SamplingParams

    if rule == "hand-back":
        hand_back_ties(monkeypatch)
    path = _attention_free_checkpoint(tmp_path, arch, ties)
    llm = LLM(str(path), dtype="bfloat16", max_model_len=96, block_size=16, quantization=quant, quant_group_size=64)
    runner = llm.engine.executor.runner
    assert runner.fused is not None
    forward, steps, fused_prefills = runner._forward, [], []

    def both(ids, pos, meta, rows=None):
        if meta.prefills:  # (on AMX with bf16, 12-bit, W8A8 or packed W8A16 experts through the fused step too)
            fused_prefills.append(runner.fused.applicable(ids.shape[0], meta))
            return forward(ids, pos, meta, rows)
        want = runner.model(ids, pos, runner.kv_caches, meta).clone()  # the modules, on the kernels
        want_kv = [c.clone() for c in runner.kv_caches]
        got = runner.fused(ids, pos, meta)
        assert torch.equal(got, want)
        assert all(torch.equal(a, b) for a, b in zip(runner.kv_caches, want_kv))
        steps.append(ids.shape[0])
        return got

    runner._forward = both
    gen = torch.Generator().manual_seed(4)
    prompts = [{"prompt_token_ids": torch.randint(3, 250, (n,), generator=gen).tolist()} for n in (4, 9, 21, 3, 40)]
    llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert steps == [5] * 5
    handbacks, tied = runner.fused.decoder.handbacks, runner.fused.decoder.handback_rows
    moe_layers = 0 if arch == "qwen3" else 3
    fused_steps = 5 + sum(fused_prefills)
    if rule == "torch":
        assert handbacks == 0, handbacks
    elif ties == "all":
        assert handbacks == fused_steps * moe_layers, handbacks
    else:  # (decode steps of 5 rows: a hand-back of fewer rows leaves the step's picks for the others)
        assert 0 < handbacks <= tied < 5 * handbacks, (handbacks, tied)


@pytest.mark.skipif(cpu.variant() not in ("avx512", "avx512-noamx", "avx2"), reason=f"x86 kernels: {cpu.describe()}")
# (w8a16: on AVX-512 without AMX the packed int8 experts' scratch (gemm_w8p.c), on AMX and AVX2 the int8 experts'
# one-row path and its scratch (AVX-512) or their per-expert GEMVs')
@pytest.mark.parametrize("quant", [None, "w8a16", "w4a16"])  # (w4a16 in groups of 64: the experts' width is 64)
def test_the_fused_steps_experts_run_in_its_workspace(tmp_path, quant):
    """The routed experts take their scratch from the fused step's workspace (moe.h moe_experts_ws; the step allocates
    nothing): the decoder sizes it with it_moe_experts_ws_bytes for its MoE layers' shapes, and a workspace without
    that part is refused (-1: too small), never overrun."""
    from infertune import LLM, SamplingParams

    path = _attention_free_checkpoint(tmp_path, "qwen3_moe")
    group = {"quant_group_size": 64} if quant == "w4a16" else {}
    llm = LLM(str(path), dtype="bfloat16", max_model_len=96, block_size=16, quantization=quant, **group)
    decoder = llm.engine.executor.runner.fused.decoder
    lib, cm = decoder.lib, decoder.cmodel
    rows = max(decoder.max_rows, decoder.max_prefill_rows)
    base = lib.it_decode_workspace_bytes(ctypes.byref(cm), rows, decoder.max_context)
    experts = lib.it_moe_experts_ws_bytes(rows, cm.moe_top_k, cm.moe_experts, cm.hidden, 64, cm.nthreads)
    assert experts > 0 and decoder.step.work_bytes == base + experts
    # more tokens, more scratch; and at least the grouped rows themselves (x, gate_up, act, down of T k rows)
    t, k, e, h, i = 16, cm.moe_top_k, cm.moe_experts, cm.hidden, 64  # (the checkpoint's moe_intermediate_size)
    assert lib.it_moe_experts_ws_bytes(2 * t, k, e, h, i, 2) > lib.it_moe_experts_ws_bytes(t, k, e, h, i, 2)
    assert lib.it_moe_experts_ws_bytes(t, k, e, h, i, 2) >= t * k * (2 * h + 3 * i) * 2
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prompt = [{"prompt_token_ids": [5, 9, 14, 3]}]
    want = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    # a step of T rows lays its workspace out for T and its block table's context (the same prompt again: the same
    # tables), the experts' part last
    # (where the fused step takes prompts, AMX with bf16 experts, the prompt's step is the largest: T = 4)
    ctx = decoder.step.max_blocks * cm.block_size
    t1 = len(prompt[0]["prompt_token_ids"]) if decoder.max_prefill_rows else 1
    base1 = lib.it_decode_workspace_bytes(ctypes.byref(cm), t1, ctx)
    one = lib.it_moe_experts_ws_bytes(t1, k, e, h, i, cm.nthreads)
    decoder.step.work_bytes = base1 + one - 1
    with pytest.raises(RuntimeError, match="workspace too small"):
        llm.generate(prompt, params, use_tqdm=False)
    decoder.step.work_bytes = base1 + one  # (exactly enough)
    assert llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == want
    decoder.step.work_bytes = base + experts


def test_the_router_kernel_takes_up_to_its_most_experts(ks):
    """The kernels' router keeps its scratch on the stack, for up to MOE_MAX_EXPERTS experts (the C side's
    IT_MOE_MAX_EXPERTS, asked of the library); past it, route() decides (None), never an error."""
    lib = getattr(ks, "lib", None)
    if hasattr(lib, "it_moe_max_experts"):
        assert lib.it_moe_max_experts() == cpu.MOE_MAX_EXPERTS
    big = cpu.MOE_MAX_EXPERTS + 16
    assert ks.moe_route(torch.randn(2, big), moe_arch(big, 4, norm_topk_prob=True)) is None
    most = cpu.MOE_MAX_EXPERTS
    logits = torch.randn(3, most, generator=torch.Generator().manual_seed(2))
    got = ks.moe_route(logits, moe_arch(most, 8, norm_topk_prob=True))
    want_w, want_ids = route(logits, moe_arch(most, 8, norm_topk_prob=True))
    assert got is not None and torch.equal(got.ids, want_ids)


@pytest.mark.parametrize("fused", [False, True])
def test_engine_runs_moe_on_the_reference_implementation(tiny_moe, monkeypatch, fused):
    """The contract's pure-PyTorch implementation (tests/test_kernel_interface.py TorchKernels) serves the MoE
    layers through the same seam: every router and experts call reaches it, per module or from the fused step's
    FusedModel alone (its MoE layers' FusedMoE carry all a step needs). Per module the greedy tokens are the
    engine's on torch's operators; the fused step's own attention (fp32 scores, not SDPA) may part tokens from
    there, and its logprobs are as close to HF transformers' in fp32 as the engine's on torch."""
    from conftest import hf_model
    from test_kernel_interface import TorchKernels
    from test_kernels import _hf_logprob_errors

    from infertune import LLM
    from infertune.backends.cpu import CPUBackend

    gen = torch.Generator().manual_seed(5)
    prompts = [{"prompt_token_ids": torch.randint(3, 250, (n,), generator=gen).tolist()} for n in (5, 17)]
    plain = LLM(str(tiny_moe), dtype="bfloat16", decode_kernels="off", max_model_len=96, block_size=16)
    outs, params = _greedy(plain, prompts, 8)
    want = [o.outputs[0].token_ids for o in outs]
    ref = TorchKernels(fused=fused)
    monkeypatch.setattr(CPUBackend, "decode_kernels", lambda self: ref)
    llm = LLM(str(tiny_moe), dtype="bfloat16", max_model_len=96, block_size=16)
    assert (llm.engine.executor.runner.fused is not None) == fused
    got = [o.outputs[0].token_ids for o in _greedy(llm, prompts, 8)[0]]
    # (the prompt step's 22 rows route in torch: ROUTER_KERNEL_ROWS; the fused step's take moe_route too)
    assert ref.calls["moe_experts"] >= 8 * 3 and ref.calls["moe_route"] >= 7 * 3
    if not fused:
        assert got == want
        return
    assert ref.calls["fused_step"] >= 7
    hf = hf_model(tiny_moe).float()
    errors = {}
    for name, engine in (("plain", plain), ("fused", llm)):
        errors[name] = max(_hf_logprob_errors(engine, prompts, params, hf, argmax=False))
    assert errors["fused"] <= 1.5 * errors["plain"] + 0.02, errors


@pytest.mark.skipif(cpu.variant() not in ("avx512", "avx512-noamx"), reason=f"AVX-512 kernels: {cpu.describe()}")
def test_profile_says_why_the_last_layers_expert_load_is_smaller(tmp_path):
    """A prompt step in the fused step routes only the sampled rows through the last layer (the test above): the
    expert-load table says so under that layer's row, whose count is the hand arithmetic's (every prompt's last
    token and the decodes, x top-k) against the other layers' (every token); a table with equal counts has no note."""
    from infertune import LLM, SamplingParams
    from infertune.profile.profile_cmd import _format_expert_load, expert_load_rows
    from infertune.profile.timeline import profile_workload

    path = _attention_free_checkpoint(tmp_path, "qwen3_moe")
    input_len, output_len, batch = 9, 5, 2
    llm = LLM(str(path), dtype="bfloat16", max_model_len=32, max_num_seqs=batch)
    if llm.engine.executor.runner.fused.decoder.max_prefill_rows < input_len * batch:
        pytest.skip("the fused step does not take this prompt step here: every layer routes every row")
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    result = profile_workload(llm, input_len, output_len, batch, params, warmup=False)
    rows = expert_load_rows({name: list(counts) for name, counts in result.expert_load.items()})
    every, sampled = (input_len + output_len - 1) * batch * 4, output_len * batch * 4  # top-4
    assert [r["routed"] for r in rows] == [every] * (len(rows) - 1) + [sampled]
    text = "\n".join(_format_expert_load(rows))
    assert f"note: {rows[-1]['layer']} routed {sampled} assignments against the other layers' {every}" in text
    assert "note:" not in "\n".join(_format_expert_load(rows[:-1]))
