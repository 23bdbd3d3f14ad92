"""Fused C routing kernels for decoding: the same function as the PyTorch path, and a safe fallback."""

import contextlib
import gc

import pytest
import torch

from vlm_retrofit import RouterConfig, attach_routers
from vlm_retrofit.routing import DepthRouter, SkipGate, SourceStack, native
from vlm_retrofit.testing import tiny_inputs, tiny_vlm

needs_compiler = pytest.mark.skipif(native.library() is None, reason="no C compiler: routing stays in PyTorch ops")


@pytest.fixture
def torch_routing(monkeypatch):
    """Streams built inside use the PyTorch ops even where the fused kernels are available."""
    monkeypatch.setattr(native, "usable", lambda first: False)


def _router(sources: int, d: int = 16) -> DepthRouter:
    router = DepthRouter(d, sources, source_bias=True)
    with torch.no_grad():
        router.query.normal_()
        router.bias.normal_()
        router.key_norm_weight.uniform_(0.5, 2.0)
    return router


def _stream(first, steps, capacity):
    """A buffered stream: each step is ('delta', output, routed_input, present) or ('drop',)."""
    stack = SourceStack(first, capacity, 1e-6)
    for step in steps:
        if step[0] == "drop":
            stack.drop()
        else:
            stack.push_delta(*step[1:])
    return stack


@needs_compiler
@pytest.mark.parametrize("batch,tokens,d", [(1, 1, 16), (1, 3, 16), (4, 1, 16), (2, 5, 16), (2, 40, 16), (1, 70, 16),
                                            (2, 5, 13), (1, 70, 2048)])
def test_fused_kernels_equal_the_pytorch_ops(batch, tokens, d, torch_routing, monkeypatch):
    """Deltas, inverse RMS, routing weights and routed inputs, with absent tokens, a dropped source and bias; past
    the kernels' chunk of 64 tokens too (a prefill's), a width that is no multiple of their lanes, and wide rows
    (chunks of fewer tokens)."""
    shape = (batch, tokens, d)
    first = torch.randn(shape) * 50
    absent = torch.rand(batch, tokens) < 0.5
    steps = [("delta", torch.randn(shape) * 30, torch.randn(shape), None), ("drop",),
             ("delta", torch.randn(shape), torch.randn(shape), ~absent),
             ("delta", torch.randn(shape) * 1e3, torch.randn(shape), None)]
    router = _router(6, d)
    with torch.no_grad():  # logits of the same spread at every width: rounding differences stay that small
        router.query.mul_((16 / d) ** 0.5)
    monkeypatch.setattr(SourceStack, "buffer_max_tokens", 128)  # the PyTorch ops on the same buffered layout
    with torch.no_grad():
        reference = _stream(first, steps, 6)
        assert reference.buffered and reference.native is None
        monkeypatch.undo()  # the fused kernels from here on
        fused = _stream(first, steps, 6)
        assert fused.native is not None
        # The subtraction is the same single rounding; the RMS sums in another order.
        assert torch.equal(fused.flat_values(), reference.flat_values())
        torch.testing.assert_close(fused.flat_inv_rms(), reference.flat_inv_rms(), atol=0, rtol=1e-6)
        # Scores sum d products in another order than torch.mv: on sources of ~1e3 the mix moves with d.
        routed_atol = 1e-4 * max(1, d // 16)
        for _ in range(2):  # two routers: each writes its own rows, the first result stays intact
            expected, got = router(reference), router(fused)
            torch.testing.assert_close(got[1], expected[1], atol=1e-6, rtol=1e-5)
            torch.testing.assert_close(got[0], expected[0], atol=routed_atol, rtol=1e-5)
            assert got[0].shape == shape and got[0].dtype == torch.float32
        first_result = router(fused)
        fused.push_delta(torch.randn(shape), first_result[0])
        second = router(fused)
        assert second[0].data_ptr() != first_result[0].data_ptr()
        torch.testing.assert_close(first_result[0], expected[0], atol=routed_atol, rtol=1e-5)


@needs_compiler
@pytest.mark.parametrize("d", [13, 64, 2048])
def test_a_tokens_routing_does_not_depend_on_the_rest_of_the_batch(d):
    """The kernels score and mix rows four at a time, grouped across tokens and sources: each token's routing weights
    and routed input are still bitwise those of the token routed alone (with absent sources and a source bias)."""
    tokens, sources = 23, 7
    values = [torch.randn(1, tokens, d) * 10 ** (i % 3) for i in range(sources)]
    present = [None if i % 3 == 0 else torch.rand(1, tokens) < 0.6 for i in range(sources)]
    router = _router(sources, d)

    def route(token: slice) -> tuple[torch.Tensor, torch.Tensor]:
        stack = SourceStack(values[0][:, token], sources, 1e-6)
        assert stack.native is not None
        for value, mask in zip(values[1:], present[1:]):
            stack.push(value[:, token], None if mask is None else mask[:, token])
        return router(stack)

    with torch.no_grad():
        routed, alpha = route(slice(None))
        for t in (0, 5, 11, 22):
            alone_routed, alone_alpha = route(slice(t, t + 1))
            assert torch.equal(alone_routed, routed[:, t : t + 1]), t
            assert torch.equal(alone_alpha, alpha[:, :, t : t + 1]), t


@needs_compiler
@pytest.mark.parametrize("with_gate", [False, True])
@pytest.mark.parametrize("earlier_source", ["present", "absent", "dropped"])
def test_one_call_push_and_mix_equals_the_two_steps(earlier_source, with_gate):
    """A layer hook's push and router (and skip gate) in one call: bitwise the push then the router, rows kept apart;
    after a dropped source too (the biases then follow the slots)."""
    d, shape = 16, (2, 3, 16)
    first, output, routed = torch.randn(shape) * 20, torch.randn(shape) * 5, torch.randn(shape)
    absent = torch.rand(2, 3) < 0.5 if earlier_source == "absent" else None
    earlier = [("delta", torch.randn(shape), torch.randn(shape), absent)]
    if earlier_source == "dropped":
        earlier.append(("drop",))
    router, gate = _router(5, d), SkipGate(d, init_bias=0.5)
    with torch.no_grad():
        gate.query.normal_()
        apart, together = _stream(first, earlier, 5), _stream(first, earlier, 5)
        before = router(together)  # an earlier router's rows must stay intact
        saved = before[0].clone()
        router(apart)
        apart.push_delta(output, routed)
        expected = router(apart)
        gate_params = gate._inference_params() if with_gate else None
        row = together.push_delta_and_route(output, routed, router._inference_params()[1], gate_params)
    assert row == 1 and len(together) == len(apart) == 3 and together.any_absent == (earlier_source == "absent")
    assert together.num_slots == apart.num_slots
    assert torch.equal(together.flat_values(), apart.flat_values())
    assert torch.equal(together.flat_inv_rms(), apart.flat_inv_rms())
    assert torch.equal(together.native.routed_rows[row], expected[0])
    assert torch.equal(together.native.alpha_row(row), expected[1])
    if with_gate:
        torch.testing.assert_close(together.native.gate_run_row(row), gate(expected[0], 1e-6), atol=1e-6, rtol=1e-5)
    else:
        assert together.native.gate_run_row(row) is None
    assert torch.equal(before[0], saved)


@needs_compiler
def test_one_call_push_and_mix_declines_where_it_does_not_apply():
    """With unusual inputs, or more sources than the router has biases for: nothing is pushed."""
    shape = (1, 1, 16)
    router = _router(2)
    with torch.no_grad():
        params = router._inference_params()[1]
        dropped = _stream(torch.randn(shape), [("drop",)], 4)  # the new source would be slot 2: no bias for it
        assert dropped.push_delta_and_route(torch.randn(shape), torch.randn(shape), params) is None
        assert len(dropped) == 1 and dropped.num_slots == 2
        plain = _stream(torch.randn(shape), [], 4)
        strided = torch.randn(1, 16, 2)[..., 0].unsqueeze(0)  # not contiguous
        assert plain.push_delta_and_route(strided, torch.randn(shape), params) is None and len(plain) == 1
        assert plain.push_delta_and_route(torch.randn(shape), strided, params) is None and len(plain) == 1
        assert plain.native.routers_run == 0


@needs_compiler
def test_decoding_steps_route_in_one_call_per_layer(monkeypatch):
    """Skipping off, every buffered forward's layer hooks and final norm hook take the one-call path."""
    model, tokenizer = tiny_vlm("llama", num_hidden_layers=4)
    adapter = attach_routers(model, RouterConfig(block_size=1))
    calls = []
    original = native.NativeStream.whole_routing

    def counted_routing(self, params):
        route = original(self, params)

        def counted(*args):
            result = route(*args)
            calls.append(result is not None)
            return result
        return counted

    monkeypatch.setattr(native.NativeStream, "whole_routing", counted_routing)
    inputs = tiny_inputs(tokenizer, batch=1)
    with torch.no_grad():
        model.generate(**inputs, max_new_tokens=3, min_new_tokens=3, do_sample=False,
                       pad_token_id=tokenizer.pad_token_id)
    assert len(adapter.routers) == 4  # routers in front of layers 1-3 and the final norm
    # Each forward runs all 4 (this short prompt's prefill is buffered too: at most 64 tokens)
    assert inputs["input_ids"].numel() <= SourceStack.buffer_max_tokens
    assert calls == [True] * 4 * 3


@needs_compiler
def test_identity_routers_give_the_plain_residual_sum():
    d, shape = 16, (1, 1, 16)
    sources = [torch.randn(shape) for _ in range(5)]
    with torch.no_grad():
        stack = SourceStack(sources[0], 5, 1e-6)
        for source in sources[1:]:
            stack.push_delta(source, torch.zeros(shape))
        assert stack.native is not None
        mixed, alpha = DepthRouter(d, 5, source_bias=True)(stack)
    torch.testing.assert_close(mixed, sum(sources), atol=1e-6, rtol=0)
    torch.testing.assert_close(alpha, torch.full_like(alpha, 0.2))


@needs_compiler
def test_more_routers_than_rows_fall_back_to_pytorch_ops():
    """The kernels write row r for the r-th router of a forward; an extra call must not write past the rows."""
    shape = (1, 1, 16)
    router = _router(3)
    with torch.no_grad():
        stack = SourceStack(torch.randn(shape), 3, 1e-6)
        stack.push_delta(torch.randn(shape), torch.randn(shape))
        results = [router(stack) for _ in range(5)]
    assert stack.native.routers_run == 3
    for mixed, alpha in results[1:]:
        torch.testing.assert_close(mixed, results[0][0], atol=1e-5, rtol=1e-6)
        torch.testing.assert_close(alpha, results[0][1], atol=1e-6, rtol=1e-6)


def test_only_buffered_fp32_cpu_streams_use_the_kernels():
    with torch.no_grad():
        assert SourceStack(torch.randn(1, 1, 16, dtype=torch.bfloat16), 3, 1e-6).native is None
        assert SourceStack(torch.randn(1, SourceStack.native_max_tokens + 1, 16), 3, 1e-6).native is None
        assert SourceStack(torch.randn(1, SourceStack.native_max_tokens, 16), 3, 1e-6).native is not None
    assert SourceStack(torch.randn(1, 1, 16), 3, 1e-6).native is None  # autograd: the listed layout


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """library() builds again, into an empty cache folder."""
    monkeypatch.setattr(native, "_library", None)
    monkeypatch.setattr(native, "_tried", False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path


@needs_compiler
def test_the_kernels_build_once_into_the_cache(fresh_build):
    assert native.library() is not None
    built = list((fresh_build / "vlm_retrofit").glob("routing-*.so"))
    assert len(built) == 1 and not list(built[0].parent.glob("tmp*"))  # the temporary build folder is gone


@needs_compiler
def test_a_damaged_cached_library_is_built_again(fresh_build, monkeypatch):
    assert native.library() is not None
    (built,) = (fresh_build / "vlm_retrofit").glob("routing-*.so")
    # The same file name in another cache folder, damaged (never overwrite a loaded library in place).
    other = fresh_build / "other"
    damaged = other / "vlm_retrofit" / built.name
    damaged.parent.mkdir(parents=True)
    damaged.write_bytes(b"not a shared library")
    monkeypatch.setenv("XDG_CACHE_HOME", str(other))
    monkeypatch.setattr(native, "_library", None)
    monkeypatch.setattr(native, "_tried", False)
    assert native.library() is not None
    assert damaged.read_bytes() != b"not a shared library"  # replaced by a fresh build


def test_a_cache_folder_others_can_write_to_is_not_loaded_from(fresh_build):
    folder = fresh_build / "vlm_retrofit"
    folder.mkdir()
    folder.chmod(0o777)
    assert native.library() is None
    assert not list(folder.glob("*.so"))


@needs_compiler
def test_the_kernels_are_called_through_an_extension_module_where_python_headers_exist(fresh_build, monkeypatch):
    """Python's headers installed: a CPython extension (a ctypes call cost ~5 us per layer at decode); without them
    the same kernels through ctypes."""
    if native._python_headers() is None:
        pytest.skip("this Python has no headers")
    assert native.library().__name__ == native.MODULE_NAME
    with pytest.raises(TypeError, match="expected 6 arguments"):  # refused in C, before any pointer is read
        native.library().vr_push_route_whole(None, 0)
    monkeypatch.setattr(native, "_python_headers", lambda: None)
    monkeypatch.setattr(native, "_library", None)
    monkeypatch.setattr(native, "_tried", False)
    assert isinstance(native.library(), native.ctypes.CDLL)


@needs_compiler
@pytest.mark.parametrize("skip_policy", [None, "random"])
def test_both_calling_fronts_give_the_same_bits(skip_policy, monkeypatch, tmp_path):
    """A padded batch with images generated through the extension module and through ctypes: the same kernels, so
    bitwise the same logits (whole-forward calls without a skip policy; push, route and gate calls with one)."""
    if native._python_headers() is None:
        pytest.skip("this Python has no headers: ctypes is the only front")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    fronts = {front: native._build((front,)) for front in ("module", "ctypes")}
    model, processor = tiny_vlm("qwen2_vl")
    adapter = attach_routers(model, RouterConfig(block_size=1, init_scale=0.5, skip_gate=True))
    with torch.no_grad():
        for router in adapter.routers.values():
            router.bias.normal_()
    inputs = tiny_inputs(processor, batch=2)
    scores = {}
    for front, kernels in fronts.items():
        monkeypatch.setattr(native, "_library", kernels)
        adapter.detach()  # a new stream (its kernels are taken when it is made)
        adapter._attach()
        torch.manual_seed(0)
        with torch.no_grad(), (adapter.skipping(skip_policy, rate=0.3) if skip_policy else contextlib.nullcontext()):
            scores[front] = model.generate(**inputs, max_new_tokens=5, do_sample=False, output_scores=True,
                                           return_dict_in_generate=True,
                                           pad_token_id=processor.tokenizer.pad_token_id).scores
    for a, b in zip(scores["module"], scores["ctypes"], strict=True):
        assert torch.equal(a, b)


@needs_compiler
def test_unusual_inputs_fall_back_to_pytorch_ops():
    """A non-contiguous layer output, or a broadcastable one, is pushed by PyTorch ops (which check it)."""
    d = 16
    with torch.no_grad():
        output = torch.randn(1, d, 2)[..., 0].unsqueeze(0)  # [1, 1, d], not contiguous
        routed = torch.randn(1, 1, d)
        stack = SourceStack(torch.randn(1, 1, d), 3, 1e-6)
        assert not output.is_contiguous() and not stack.native.push_delta(1, output, routed)
        stack.push_delta(output, routed)
        torch.testing.assert_close(stack.source(1), output - routed)
        stack = SourceStack(torch.randn(2, 1, d), 3, 1e-6)
        assert not stack.native.push_delta(1, torch.randn(1, 1, d), torch.randn(2, 1, d))  # would broadcast
        assert not stack.native.push_delta(5, torch.randn(2, 1, d), torch.randn(2, 1, d))  # no such slot
        short_bias = DepthRouter(d, 1, source_bias=True)  # fewer biases than sources written
        assert stack.native.route(1, 2, False, short_bias._inference_params()[1], None) is None
        narrow = DepthRouter(d // 2, 2, source_bias=True)  # a scorer of another width would be read past its end
        assert stack.native.route(1, 1, False, narrow._inference_params()[1], None) is None
        stack.native.routers_run = stack.native._capacity  # every row written: none is overwritten
        assert stack.native.route(1, 1, False, DepthRouter(d, 2, source_bias=True)._inference_params()[1], None) is None


def test_a_failing_compiler_leaves_routing_in_pytorch_ops(fresh_build, monkeypatch, caplog):
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    with caplog.at_level("INFO", logger=native.__name__):
        assert native.library() is None
    assert "stays in PyTorch ops" in caplog.text
    with torch.no_grad():
        stack = SourceStack(torch.randn(1, 1, 16), 3, 1e-6)
        stack.push_delta(torch.randn(1, 1, 16), torch.randn(1, 1, 16))
        assert stack.native is None
        assert _router(3)(stack)[0].shape == (1, 1, 16)


def test_the_switch_turns_the_kernels_off(fresh_build, monkeypatch):
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    assert native.library() is None
    assert not list(fresh_build.glob("**/*.so"))


@needs_compiler
def test_generation_with_trained_like_routers_matches_the_pytorch_path(monkeypatch):
    """Greedy tokens equal and per-step logits within 1e-4, on a padded batch with images (decode is buffered)."""
    model, processor = tiny_vlm("qwen2_vl")
    adapter = attach_routers(model, RouterConfig(block_size=1, init_scale=0.5))
    with torch.no_grad():
        for router in adapter.routers.values():
            if router.bias is not None:
                router.bias.normal_()
    inputs = tiny_inputs(processor, batch=2)

    def generate():
        with torch.no_grad():
            return model.generate(**inputs, max_new_tokens=6, do_sample=False, output_scores=True,
                                  return_dict_in_generate=True, pad_token_id=processor.tokenizer.pad_token_id)

    fused = generate()
    fused_weights = adapter.last_routing_weights  # of the last decoding step, left in the kernels' buffer
    monkeypatch.setattr(native, "usable", lambda first: False)
    reference = generate()
    assert torch.equal(fused.sequences, reference.sequences)
    for a, b in zip(fused.scores, reference.scores):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
    reference_weights = adapter.last_routing_weights
    assert set(fused_weights) == set(reference_weights) == set(adapter.routers)
    for key, alpha in reference_weights.items():
        assert alpha.shape == (adapter.routers[key].num_sources, 2, 1)
        torch.testing.assert_close(fused_weights[key], alpha, atol=1e-5, rtol=1e-5)


@needs_compiler
def test_fused_gate_run_probability_equals_the_gate_module():
    """A skip gate evaluated by the router's kernel on its output: the gate module's probability, to rounding."""
    d, shape = 16, (2, 3, 16)
    router, gate = _router(4, d), SkipGate(d, init_bias=1.0)
    with torch.no_grad():
        gate.query.normal_()
        gate.norm_weight.uniform_(0.5, 2.0)
        stack = _stream(torch.randn(shape) * 20, [("delta", torch.randn(shape) * 5, torch.randn(shape), None)], 4)
        row = stack.route_fused(router._inference_params()[1], gate._inference_params())
        run = stack.native.gate_run_row(row)
        expected = gate(stack.native.routed_rows[row], 1e-6)
        assert run.shape == (2, 3) and 0.0 < float(expected.min()) < float(expected.max()) < 1.0
        torch.testing.assert_close(run, expected, atol=1e-6, rtol=1e-5)
        no_gate = stack.route_fused(router._inference_params()[1])
        assert stack.native.gate_run_row(no_gate) is None  # no gate: none computed
        narrow = SkipGate(d // 2, init_bias=1.0)._inference_params()  # one the kernel cannot read: none either
        assert stack.native.gate_run_row(stack.route_fused(router._inference_params()[1], narrow)) is None


@needs_compiler
def test_gate_skipping_decides_the_same_through_the_fused_kernels(monkeypatch):
    """Generation under the gate policy: the same tokens and the same skips with the gates in the kernels."""
    model, processor = tiny_vlm("llama", num_hidden_layers=6)
    adapter = attach_routers(model, RouterConfig(block_size=1, init_scale=0.5, skip_gate=True))
    with torch.no_grad():
        for gate in adapter.gates.values():
            gate.query.normal_(std=0.5)
    inputs = tiny_inputs(processor, batch=2)

    def generate():
        with torch.no_grad(), adapter.skipping("gate", threshold=0.7) as report:
            out = model.generate(**inputs, max_new_tokens=6, min_new_tokens=6, do_sample=False,
                                 pad_token_id=processor.pad_token_id)
        return out, report.skip_rates

    module_calls = []
    original = SkipGate.forward
    monkeypatch.setattr(SkipGate, "forward", lambda self, *args: module_calls.append(1) or original(self, *args))
    fused, fused_rates = generate()
    assert not module_calls  # every gate ran in the router's kernel
    monkeypatch.setattr(native, "usable", lambda first: False)
    reference, reference_rates = generate()
    assert module_calls
    assert torch.equal(fused, reference)
    assert fused_rates == reference_rates and 0 < sum(fused_rates) < len(fused_rates)


@needs_compiler
@pytest.mark.parametrize("shape", [(1, 1, 64), (2, 150, 64)])
def test_fused_router_at_uniform_routing_is_the_residual_sum_bit_for_bit(shape):
    """At init a routed input (a decode step's, a prefill's) is the plain sum of the stream's sources in the residual
    order, for every source count (in fp32, (1/K) * K is not 1 for K = 41, 47, 55, 61, ...)."""
    first = torch.randn(shape) * 1000
    outputs = [torch.randn(shape) * 100 for _ in range(62)]
    with torch.no_grad():
        stack = SourceStack(first, 64, 1e-6)
        assert stack.native is not None
        routed_input, residual = first, first
        for n, output in enumerate(outputs, start=1):
            stack.push_delta(routed_input + output, routed_input)
            residual = residual + stack.source(n)
            routed_input, _ = DepthRouter(64, n + 1, source_bias=True)(stack)
            assert torch.equal(routed_input, residual), n


@needs_compiler
def test_decoding_steps_reuse_their_stream_unless_something_holds_what_it_handed_out(monkeypatch):
    """A decoding step routes in the last step's buffers (a new stream costs a third of a step's routing), gives the
    same logits as in new buffers, and leaves alone any tensor the last step handed out that is still held."""
    from transformers import DynamicCache

    model, tokenizer = tiny_vlm("llama", num_hidden_layers=4)
    adapter = attach_routers(model, RouterConfig(block_size=1, init_scale=0.5))
    inputs = tiny_inputs(tokenizer, batch=1)

    def decode(steps: int):
        """Prefill, then `steps` greedy decoding forwards: each step's logits and the stream it routed in."""
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            out = model(**inputs, past_key_values=cache, use_cache=True)
            logits, stacks = [], []
            for _ in range(steps):
                token = out.logits[:, -1:].argmax(-1)
                out = model(input_ids=token, past_key_values=cache, use_cache=True)
                logits.append(out.logits)
                stacks.append(adapter._state.stack)
        return logits, stacks

    gc.disable()  # reuse must follow from reference counts alone, not from when the garbage collector runs
    try:
        logits, stacks = decode(4)
    finally:
        gc.enable()
    assert all(stack is stacks[0] for stack in stacks)  # one stream for every decoding step
    monkeypatch.setattr(SourceStack, "restart", lambda self, first: False)
    fresh_logits, fresh_stacks = decode(4)
    assert len({id(stack) for stack in fresh_stacks}) == 4
    for reused, fresh in zip(logits, fresh_logits):
        assert torch.equal(reused, fresh)
    monkeypatch.undo()

    held = {}

    def keep_input(module, args, output):  # a layer's (routed) input, kept by a caller
        held.setdefault("input", args[0])

    layer_input = model.model.layers[2].register_forward_hook(keep_input)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(**inputs, past_key_values=cache, use_cache=True)
        model(input_ids=inputs["input_ids"][:, -1:], past_key_values=cache, use_cache=True)
        weights = adapter.last_routing_weights
        first_stack = adapter._state.stack
        saved = {"input": held["input"].clone(), **{key: alpha.clone() for key, alpha in weights.items()}}
        model(input_ids=inputs["input_ids"][:, -2:-1], past_key_values=cache, use_cache=True)
    layer_input.remove()
    assert adapter._state.stack is not first_stack  # the held tensors point into the last step's buffers
    assert torch.equal(held["input"], saved.pop("input"))
    for key, alpha in saved.items():
        assert torch.equal(weights[key], alpha)


def test_a_layer_output_of_another_shape_is_refused_not_written_past_the_stream():
    """A forward hook that returns a value replaces the layer's output: a wrong shape made the fallback's `out=` resize
    a buffer the kernels point into (memory corruption, a crash later); it is refused by name."""
    model, tokenizer = tiny_vlm("llama", num_hidden_layers=4)
    attach_routers(model, RouterConfig(block_size=1))
    inputs = tiny_inputs(tokenizer, batch=1)
    other = torch.zeros(1, 3, model.config.hidden_size)
    model.model.layers[1].register_forward_hook(lambda module, args, output: other)
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"does a hook on a decoder layer return a value"):
        model(input_ids=inputs["input_ids"][:, :1])


@needs_compiler
def test_a_prefill_stream_reuses_the_last_ones_memory_unless_something_holds_it():
    """Fused-kernel streams take their buffers from memory the adapter keeps (a new prefill stream faulted in every
    page again: as long as its routing): the same logits as in new memory; a caller's held tensor is left alone."""
    model, tokenizer = tiny_vlm("llama", num_hidden_layers=4)
    adapter = attach_routers(model, RouterConfig(block_size=1, init_scale=0.5))
    prompt = tiny_inputs(tokenizer, batch=1)["input_ids"]
    other = prompt[:, :-4]  # shorter: the kept memory holds it (a longer one gets new, larger memory)

    def forward(input_ids):
        with torch.no_grad():
            logits = model(input_ids=input_ids).logits
        return logits, adapter._state.stack._values.data_ptr()

    first, first_memory = forward(prompt)
    again, again_memory = forward(other)  # the last stream is dropped first: its memory is free
    assert again_memory == first_memory
    adapter._stream_buffers = None  # new memory for every stream
    assert torch.equal(forward(prompt)[0], first) and torch.equal(forward(other)[0], again)
    adapter._stream_buffers = native.StreamBuffers()

    held = {}
    handle = model.model.layers[2].register_forward_hook(lambda module, args, output: held.setdefault("in", args[0]))
    forward(prompt)
    handle.remove()
    saved, kept = held["in"].clone(), adapter._stream_buffers._flat["routed"]
    assert held["in"].untyped_storage().data_ptr() == kept.data_ptr()  # a router's output, in the kept memory
    forward(other)
    assert adapter._state.stack.native._routed.untyped_storage().data_ptr() != kept.data_ptr()
    assert torch.equal(held["in"], saved)  # the routed input it kept was not written over


def test_stream_buffers_hand_out_kept_memory_only_while_nothing_holds_it():
    buffers = native.StreamBuffers()
    first = buffers.empty("values", (3, 4), torch.float32)
    kept = buffers._flat["values"]
    assert first.data_ptr() == kept.data_ptr()
    second = buffers.empty("values", (2, 4), torch.float32)  # `first` still holds the memory
    assert second.data_ptr() != kept.data_ptr() and buffers._flat["values"] is kept  # the larger one stays kept
    del first
    smaller = buffers.empty("values", (2, 5), torch.float32)
    assert smaller.data_ptr() == kept.data_ptr() and smaller.shape == (2, 5)
    del smaller
    larger = buffers.empty("values", (5, 5), torch.float32)  # too small: a new one, kept from now on
    assert larger.data_ptr() != kept.data_ptr() and buffers._flat["values"].numel() == 25
    assert buffers.empty("present", (2, 2), torch.bool).dtype == torch.bool


@needs_compiler
def test_whole_forward_routing_equals_push_route_and_declines_what_it_cannot_take():
    """The packed per-forward call (`NativeStream.whole_routing`) writes the bits `push_route` writes; it declines,
    writing nothing, an output the kernels cannot read and a router whose bias is too short for its sources."""
    d, shape = 16, (1, 3, 16)
    first = torch.randn(shape) * 20
    routers = [_router(2, d), _router(3, d), _router(2, d)]  # the third's bias is one short of its 3 sources
    outputs = [torch.randn(shape) * 5 for _ in range(3)]
    with torch.no_grad():
        params = [router._inference_params()[1] for router in routers]
        apart, together = SourceStack(first, 4, 1e-6), SourceStack(first, 4, 1e-6)
        route = together.native.whole_routing(params)
        routed_apart = routed_together = first
        for block in range(2):
            row = apart.native.push_route(block + 1, outputs[block], routed_apart, False, params[block], block + 2)
            assert route(block, outputs[block], routed_together) == row == block
            routed_apart, routed_together = apart.native.routed_rows[row], together.native.routed_rows[row]
            assert torch.equal(routed_together, routed_apart)
            assert torch.equal(together.native.alpha_row(row), apart.native.alpha_row(row))
        assert route(2, outputs[2], routed_together) is None  # bias of 2 for 3 sources
        assert route(3, outputs[2], routed_together) is None  # no router after a block past the list
        assert route(1, outputs[2].transpose(1, 2).contiguous().transpose(1, 2), routed_together) is None
        assert route(1, outputs[2].double(), routed_together) is None
    assert together.native.routers_run == 2


@needs_compiler
def test_decoding_steps_reuse_the_packed_routers_until_a_router_changes(monkeypatch):
    """Each decoding step gets the last step's packed `whole_routing` function back; a router changed in place
    between steps (its folded parameters are new) is packed again, and the step routes with its new values."""
    model, tokenizer = tiny_vlm("llama", num_hidden_layers=3)
    adapter = attach_routers(model, RouterConfig(block_size=1, init_scale=0.5))
    handed_out = []
    original = native.NativeStream.whole_routing

    def recorded(self, params):
        handed_out.append(original(self, params))
        return handed_out[-1]

    monkeypatch.setattr(native.NativeStream, "whole_routing", recorded)
    ids = tiny_inputs(tokenizer, batch=1)["input_ids"][:, :5]

    def step(cache, token):
        return model(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1]

    with torch.no_grad():
        cache = model(input_ids=ids, use_cache=True).past_key_values
        token = ids[:, -1:]
        step(cache, token)
        step(cache, token)
        assert handed_out[-1] is handed_out[-2]  # the second decoding step reused the first one's packing
        next(iter(adapter.routers.values())).query.mul_(-3.0)
        fused = step(cache, token)
        assert handed_out[-1] is not handed_out[-2]
        cache.crop(-1)  # the same step again, on the PyTorch path
        monkeypatch.setattr(native, "usable", lambda first: False)
        reference = step(cache, token)
    torch.testing.assert_close(fused, reference, atol=1e-5, rtol=1e-5)


@needs_compiler
def test_a_same_shape_forward_leaves_a_held_routed_input_alone():
    """A caller keeping the very row object a layer received (no view: no storage user more) stops the stream's
    reuse too; before, the next forward of the same shape routed into it."""
    model, tokenizer = tiny_vlm("llama", num_hidden_layers=4)
    attach_routers(model, RouterConfig(block_size=1, init_scale=0.5))
    prompt = tiny_inputs(tokenizer, batch=1)["input_ids"]
    held = []
    handle = model.model.layers[2].register_forward_hook(lambda module, args, output: held.append(args[0]))
    with torch.no_grad():
        model(input_ids=prompt)
        saved = held[0].clone()
        model(input_ids=prompt.flip(1))  # the same shape, other tokens: other routed inputs
    handle.remove()
    assert not torch.equal(held[1], saved)
    assert torch.equal(held[0], saved)


def test_the_kernels_buffers_stay_on_the_cpu_and_outside_inference_mode_when_asked_outside_it():
    """Kept memory made under inference_mode is not handed to a forward outside it (its writes would raise), and
    buffers are CPU memory whatever the default device (the kernels write through their addresses)."""
    buffers = native.StreamBuffers()
    with torch.inference_mode():
        made_inside = buffers.empty("present", (2, 3), torch.bool)
    del made_inside
    with torch.no_grad():
        outside = buffers.empty("present", (2, 3), torch.bool)
        outside.fill_(True)
    assert not outside.is_inference()
    with torch.device("meta"):
        assert buffers.empty("values", (2, 3), torch.float32).device.type == "cpu"
        assert native.stream_buffer(None, "values", (2, 3), torch.float32).device.type == "cpu"


@needs_compiler
def test_generation_after_a_forward_under_inference_mode():
    model, tokenizer = tiny_vlm("llama", num_hidden_layers=4)
    attach_routers(model, RouterConfig(block_size=1, init_scale=0.5))
    inputs = tiny_inputs(tokenizer, batch=1)
    with torch.inference_mode():
        model(**inputs)
    out = model.generate(**inputs, max_new_tokens=3, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert out.shape[1] == inputs["input_ids"].shape[1] + 3


@needs_compiler
@pytest.mark.parametrize("minus_infinity_at", [0, 1])
def test_a_minus_infinity_source_bias_weighs_nothing_in_the_kernels_too(minus_infinity_at, torch_routing, monkeypatch):
    """A source whose bias is -inf takes weight 0, as in PyTorch's softmax, also where it is the first source scored
    (the kernel's running largest score is then still -inf)."""
    shape = (1, 70, 16)
    steps = [("delta", torch.randn(shape), torch.randn(shape), None), ("delta", torch.randn(shape), torch.randn(shape), None)]
    first = torch.randn(shape) * 10
    router = _router(3)
    with torch.no_grad():
        router.bias[minus_infinity_at] = float("-inf")
        monkeypatch.setattr(SourceStack, "buffer_max_tokens", 128)
        expected = router(_stream(first, steps, 3))
        monkeypatch.undo()
        fused = _stream(first, steps, 3)
        assert fused.native is not None
        got = router(fused)
    assert torch.isfinite(got[0]).all() and torch.isfinite(expected[0]).all()
    assert (got[1][minus_infinity_at] == 0).all()
    torch.testing.assert_close(got[1], expected[1], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got[0], expected[0], atol=1e-4, rtol=1e-5)


@needs_compiler
def test_routers_without_source_bias_route_through_the_kernels():
    model, tokenizer = tiny_vlm("llama", num_hidden_layers=4)
    adapter = attach_routers(model, RouterConfig(block_size=1, source_bias=False, init_scale=0.5))
    inputs = tiny_inputs(tokenizer, batch=1)
    with torch.no_grad():
        fused = model(**inputs).logits
        assert adapter._state.stack.native is not None
    with torch.enable_grad():  # the listed layout, PyTorch ops
        listed = model(**inputs).logits.detach()
    torch.testing.assert_close(fused, listed, atol=1e-5, rtol=1e-5)
    out = model.generate(**inputs, max_new_tokens=3, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert out.shape[1] == inputs["input_ids"].shape[1] + 3
