"""The depth-softmax router on its own: identity at uniform routing, the K multiplier, absent sources."""

import pytest
import torch

from vlm_retrofit.routing import DepthRouter, SkipGate, SourceStack, native


@pytest.fixture(params=["fused", "pytorch"], autouse=True)
def routing_backend(request, monkeypatch):
    """Each test runs with decode-time (buffered) routing in the fused C kernels and in PyTorch ops."""
    if request.param == "pytorch":
        monkeypatch.setattr(native, "usable", lambda first: False)
        return None
    if native.library() is None:
        pytest.skip("no C compiler: the fused routing kernels are not built here")
    return request.param


def _sources(k, b=2, t=3, d=8):
    return [torch.randn(b, t, d) for _ in range(k)]


def _stack(sources, present=None):
    """Built under the caller's grad mode: with autograd the listed layout, under no_grad the buffered one."""
    present = present or [None] * len(sources)
    stack = SourceStack(sources[0], len(sources), 1e-6)
    for source, mask in zip(sources[1:], present[1:]):
        stack.push(source, mask)
    return stack


def _route(router, sources, present=None):
    return router(_stack(sources, present))


def test_zero_query_is_plain_residual_sum():
    sources = _sources(4)
    router = DepthRouter(8, 4, source_bias=True)
    mixed, alpha = _route(router, sources)
    torch.testing.assert_close(mixed, sum(sources), atol=1e-6, rtol=0)
    torch.testing.assert_close(alpha, torch.full_like(alpha, 0.25))


def test_query_and_bias_reweight_sources():
    sources = _sources(3)
    router = DepthRouter(8, 3, source_bias=True)
    with torch.no_grad():
        router.bias.copy_(torch.tensor([0.0, 0.0, 30.0]))  # all weight on the most recent source
    mixed, alpha = _route(router, sources)
    torch.testing.assert_close(mixed, 3 * sources[2], atol=1e-5, rtol=0)
    assert alpha[2].min() > 0.999
    with torch.no_grad():
        router.bias.zero_()
        router.query.normal_()
    mixed, _ = _route(router, sources)
    assert (mixed - sum(sources)).abs().max() > 1e-3


def test_absent_sources_are_masked_and_not_counted():
    sources = _sources(3)
    router = DepthRouter(8, 3, source_bias=False)
    present = torch.tensor([[True, False, True], [True, True, True]])  # token (0, 1) lacks source 1
    mixed, alpha = _route(router, sources, [None, present, None])
    assert alpha[1][0, 1] == 0
    # K counts only present sources, so uniform routing over {s0, s2} gives s0 + s2 for that token ...
    torch.testing.assert_close(mixed[0, 1], sources[0][0, 1] + sources[2][0, 1], atol=1e-6, rtol=0)
    # ... which is plain layer dropping, and every other token keeps the full sum.
    torch.testing.assert_close(mixed[1], sum(sources)[1], atol=1e-6, rtol=0)


def test_router_gradients_reach_query_and_bias_at_init_and_gain_once_query_moves():
    sources = _sources(3)
    router = DepthRouter(8, 3, source_bias=True)
    weights = torch.randn(2, 3, 8)
    mixed, _ = _route(router, sources)
    (mixed * weights).sum().backward()
    assert router.query.grad.abs().sum() > 0 and router.bias.grad.abs().sum() > 0
    # The gain multiplies the query, so at q = 0 it cannot get a gradient yet.
    assert router.key_norm_weight.grad.abs().sum() == 0
    with torch.no_grad():
        router.query.normal_()
    router.zero_grad()
    mixed, _ = _route(router, sources)
    (mixed * weights).sum().backward()
    assert router.key_norm_weight.grad.abs().sum() > 0


def test_dtype_is_preserved_and_math_runs_in_fp32():
    sources = [s.to(torch.bfloat16) for s in _sources(3)]
    for grad in (True, False):  # the listed and the buffered layout
        with torch.set_grad_enabled(grad):
            mixed, alpha = _route(DepthRouter(8, 3, source_bias=True), sources)
        assert mixed.dtype == torch.bfloat16 and alpha.dtype == torch.float32


def test_skip_gate_starts_near_always_run():
    gate = SkipGate(8, init_bias=3.0)
    p = gate(torch.randn(2, 5, 8), 1e-6)
    assert p.shape == (2, 5)
    torch.testing.assert_close(p, torch.full_like(p, torch.sigmoid(torch.tensor(3.0)).item()))


def test_buffered_decode_layout_equals_the_listed_layout():
    sources = _sources(5, b=2, t=3)
    router = DepthRouter(8, 5, source_bias=True)
    with torch.no_grad():
        router.query.normal_()
        router.bias.normal_()
    present = [None, torch.tensor([[True, False, True], [True, True, False]]), None, None,
               torch.tensor([[False, True, True], [True, True, True]])]
    for mask in (None, present):
        with torch.no_grad():
            stack = _stack(sources, mask)
            assert stack.buffered  # no autograd: the buffered layout ...
            buffered = router(stack)
        listed_stack = _stack(sources, mask)
        assert not listed_stack.buffered  # ... and with autograd the per-source lists
        listed = router(listed_stack)
        for a, b in zip(buffered, listed):
            torch.testing.assert_close(a, b.detach(), atol=1e-5, rtol=0)
        torch.testing.assert_close(stack.key(3), listed_stack.key(3).detach())
        if mask is None:
            assert stack.present_mask() is None and listed_stack.present_mask() is None
        else:
            torch.testing.assert_close(stack.present_mask(), listed_stack.present_mask())


def test_buffered_layout_is_not_used_for_many_tokens(routing_backend):
    limit = SourceStack.native_max_tokens if routing_backend else SourceStack.buffer_max_tokens
    with torch.no_grad():
        assert SourceStack(torch.randn(1, limit, 8), 3, 1e-6).buffered
        stack = SourceStack(torch.randn(1, limit + 1, 8), 3, 1e-6)
    assert not stack.buffered


def test_every_buffered_mixing_path_equals_the_listed_layout():
    """One token (vector-matrix product) and a few tokens (multiply-sum), with and without absent sources."""
    router = DepthRouter(8, 4, source_bias=True)
    with torch.no_grad():
        router.query.normal_()
        router.bias.normal_()
    for b, t in ((1, 1), (2, 2), (2, 5)):
        sources = _sources(4, b=b, t=t)
        absent = torch.rand(b, t) < 0.5
        for mask in (None, [None, absent, None, ~absent]):
            with torch.no_grad():
                stack = _stack(sources, mask)
                assert stack.buffered
                buffered = router(stack)
            listed = router(_stack(sources, mask))
            for a, c in zip(buffered, listed):
                torch.testing.assert_close(a, c.detach(), atol=1e-5, rtol=0)


def test_a_decode_step_key_is_the_key_of_the_same_token_in_a_long_forward(routing_backend):
    """A token's key is the same alone (decoding) and among many (no cache): bitwise in PyTorch ops; the fused
    kernels sum its RMS in another order (as for every delta), the same order whatever the number of tokens."""
    tokens = torch.randn(1, 1000, 64) * 1000  # listed: above either layout's buffered limit
    with torch.no_grad():
        long_stack, short_stack = SourceStack(tokens, 2, 1e-6), SourceStack(tokens[:, -1:], 2, 1e-6)
        few_stack = SourceStack(tokens[:, -20:], 2, 1e-6)
    assert short_stack.buffered and few_stack.buffered and not long_stack.buffered
    assert torch.equal(few_stack.key(0)[:, -1:], short_stack.key(0))
    if routing_backend is None:  # PyTorch ops
        assert torch.equal(long_stack.key(0)[:, -1:], short_stack.key(0))
        assert torch.equal(long_stack.key(0)[:, -20:], few_stack.key(0))
    torch.testing.assert_close(long_stack.key(0)[:, -20:], few_stack.key(0), atol=0, rtol=1e-6)


def test_a_dropped_source_equals_one_absent_for_every_token():
    sources = _sources(5)
    router = DepthRouter(8, 5, source_bias=True)
    with torch.no_grad():
        router.query.normal_()
        router.bias.normal_()
    nobody = torch.zeros(2, 3, dtype=torch.bool)
    for grad in (True, False):  # the listed and the buffered layout
        with torch.set_grad_enabled(grad):
            absent = _route(router, sources, [None, None, nobody, None, None])
            stack = SourceStack(sources[0], 5, 1e-6)
            stack.push(sources[1])
            stack.drop()  # source 2: no token has it
            stack.push(sources[3])
            stack.push(sources[4])
            assert len(stack) == 4 and stack.num_slots == 5 and stack.slot_index().tolist() == [0, 1, 3, 4]
            dropped = router(stack)
        torch.testing.assert_close(dropped[0], absent[0], atol=1e-5, rtol=0)
        torch.testing.assert_close(stack.expand(dropped[1], 5), absent[1], atol=1e-6, rtol=0)


def test_the_buffered_layout_sees_every_parameter_update():
    """Without autograd the folded query * gain is reused between calls: in-place updates, load_state_dict and
    reassigned parameters must all show."""
    sources = _sources(3, b=1, t=1)
    router = DepthRouter(8, 3, source_bias=True)

    def routed_alike():
        with torch.no_grad():
            buffered = router(_stack(sources))[0]
        torch.testing.assert_close(buffered, router(_stack(sources))[0].detach(), atol=1e-5, rtol=0)
        return buffered

    first = routed_alike()
    with torch.no_grad():
        router.query.normal_()  # an optimizer step is an in-place update like this one
    moved = routed_alike()
    assert not torch.allclose(first, moved)
    other = DepthRouter(8, 3, source_bias=True)
    with torch.no_grad():
        other.key_norm_weight.uniform_(0.5, 2.0)
        other.query.normal_()
    router.load_state_dict(other.state_dict())
    routed_alike()
    router.key_norm_weight = torch.nn.Parameter(torch.full((8,), 3.0))
    routed_alike()


@pytest.mark.parametrize("k", [3, 7, 31])
def test_uniform_routing_is_the_residual_sum_bit_for_bit_in_the_listed_layout(k):
    """At init every mixing weight K * alpha is exactly 1: the mix is the sources' sum in the residual stream's order
    (K * softmax would round 1/K and K apart, ~1e-4 on a real model's logits)."""
    torch.manual_seed(k)
    sources = [torch.randn(2, 500, 64) * 1000 for _ in range(k)]  # 1000 tokens: listed in any grad mode
    residual = sources[0]
    for source in sources[1:]:
        residual = residual + source
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            stack = _stack(sources)
            assert not stack.buffered
            mixed, _ = DepthRouter(64, k, source_bias=True)(stack)
        assert torch.equal(mixed.detach(), residual), grad
