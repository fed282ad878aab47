"""What only compiled engines have: taps, their limits, and the compile cache.

The rest of the vLLM tests run on eager and on compiled engines alike (``helpers.MODES``); this
module checks the compiled mode's own promises on an engine with the default tap set: an await of a
location that is not a tap fails at invoke when the block's code is sure to make it, else at the
user's line, with a message naming the location, the engine's taps and the option that adds it, and
fails that request only; patterns that name nothing, and modules whose calls cannot be tapped,
fail the engine's start with asyncpp's error; a second engine of the same model loads vLLM's compiled graph from its
cache; greedy tokens equal a stock vLLM engine's (vLLM's own worker, compiled too).
"""

from __future__ import annotations

import asyncio
import inspect

import pytest
import torch

import asyncpp

pytest.importorskip("vllm")

PROMPTS = ["The quick brown fox", "Once upon a time", "asyncpp"]


@pytest.fixture(scope="module")
def compiled():
    engine = asyncpp.VllmEngine(dtype="float32", mode="compiled")
    yield engine
    engine.close()


def test_the_default_taps_are_the_layers_their_attention_and_mlp_the_embeddings_and_the_final_norm(compiled):
    assert compiled.mode == "compiled"
    n = len(compiled.tree.model.layers)
    layers = [[f"model.layers.{i}", f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"] for i in range(n)]
    assert compiled.taps == ["model.embed_tokens", *(p for trio in layers for p in trio), "model.norm"]


def test_an_untapped_location_a_block_is_sure_to_await_is_refused_at_invoke(compiled):
    async def untapped(m):
        h, r = await m.model.layers[0].output  # a tap
        return await m.model.layers[1].mlp.down_proj.output  # not one

    async def fine(m):
        return (await m.model.layers[1].output)[0][-1].clone()

    with asyncpp.trace(compiled) as t:
        good = t.invoke(PROMPTS[0], fine)
        with pytest.raises(asyncpp.TapError) as info:
            t.invoke(PROMPTS[1], untapped)  # nothing of it runs
    msg = str(info.value)
    assert msg.startswith("model.layers.1.mlp.down_proj.output is not a tap of this VllmEngine")
    assert (
        "model.layers.{0..3}" in msg
        and "taps=['model.layers.1.mlp.down_proj']" in msg
        and "mode='eager'" in msg
    )
    lines, first = inspect.getsourcelines(untapped)
    line = first + next(i for i, text in enumerate(lines) if "down_proj.output" in text)
    assert msg.endswith(f"in block {untapped.__qualname__}, {__file__}:{line}")
    assert len(t.invokes) == 1 and good.result.dim() == 1  # the trace ran the other invoke


def test_an_untapped_location_known_only_at_run_time_fails_its_request_at_the_await(compiled):
    async def untapped(m, name):
        h, r = await m.model.layers[0].output  # a tap
        return await getattr(m.model.layers[1].mlp, name).output  # not one, named at run time

    async def fine(m):
        return (await m.model.layers[1].output)[0][-1].clone()

    with pytest.raises(asyncpp.TapError) as info:
        with asyncpp.trace(compiled) as t:
            good = t.invoke(PROMPTS[0], fine)
            t.invoke(PROMPTS[1], untapped, "down_proj")
    msg = str(info.value)
    assert msg.startswith("model.layers.1.mlp.down_proj.output is not a tap of this VllmEngine")
    assert "taps=['model.layers.1.mlp.down_proj']" in msg and "mode='eager'" in msg
    notes = "\n".join(getattr(info.value, "__notes__", ()))
    assert (
        "test_vllm_compiled.py" in notes
        and "return await getattr(m.model.layers[1].mlp, name).output" in notes
    )
    assert good.result.dim() == 1  # the other request of the trace ran to its end
    with asyncpp.trace(compiled) as t:  # the engine goes on
        again = t.invoke(PROMPTS[0], fine)
    torch.testing.assert_close(again.result, good.result)


def test_what_taps_do_not_serve_is_refused_clearly(compiled):
    async def inputs_of_a_tap(m):
        return await m.model.layers[2].inputs

    async def inner_model(m):
        return await m.model.output

    async def outside_the_graph(m):  # the top-level model, logits and samples: as in eager mode
        args, kwargs = await m.inputs
        logits = (await m.logits).clone()
        return logits, (await m.samples).sampled_token_ids.clone()

    async def skip_a_layer(m):
        await m.model.layers[2].skip(None)

    with pytest.raises(
        asyncpp.TapError, match=r"model\.layers\.2\.inputs is not a tap.*taps=\['model\.layers\.2\.inputs'\]"
    ):
        with asyncpp.trace(compiled) as t:
            t.invoke(PROMPTS[0], inputs_of_a_tap)
    with pytest.raises(
        asyncpp.TapError, match=r"model\.layers\.2\.skip: .* skip needs the module called from Python"
    ):
        with asyncpp.trace(compiled) as t:
            t.invoke(PROMPTS[0], skip_a_layer)
    with pytest.raises(asyncpp.TapError, match=r"model\.output is not a tap.*`m\.output`"):
        with asyncpp.trace(compiled) as t:
            t.invoke(PROMPTS[0], inner_model)
    with asyncpp.trace(compiled) as t:
        h = t.invoke(PROMPTS[0], outside_the_graph)
    logits, sampled = h.result
    assert int(sampled) == int(logits.argmax()) == int(h.tokens[0, 0])


def test_a_tap_pattern_that_names_nothing_fails_the_start():
    with pytest.raises(
        ValueError, match=r"'model\.layers\.\*\.mpl' matches no module inside vLLM's compiled model"
    ):
        asyncpp.VllmEngine(dtype="float32", mode="compiled", taps=["model.layers.*.mpl"])


QUANT = "model.layers.0.mlp.experts.routed_experts.quant_method"


def test_a_tap_named_exactly_whose_module_cannot_have_it_fails_the_start_with_the_tap_error():
    # a MoE's experts call their quant_method with the layer itself (a module): no inputs tap can
    # carry that call. The check runs in the worker while vLLM traces the model; the caller gets
    # the TapError, not vLLM's error.
    from asyncpp.models.architectures import tiny_checkpoint

    with pytest.raises(asyncpp.TapError) as info:
        asyncpp.VllmEngine(
            str(tiny_checkpoint("qwen2_moe")), dtype="float32", mode="compiled", taps=[f"{QUANT}.inputs"]
        )
    msg = str(info.value)
    assert msg.startswith(f"{QUANT}.inputs cannot be a tap: the module is called with (layer=RoutedExperts, ")
    assert "x=Tensor" in msg
    assert "Engine core initialization failed" in str(info.value.__cause__)  # vLLM's own, kept


def test_a_wildcard_leaves_out_the_modules_whose_calls_cannot_be_tapped():
    from asyncpp.models.architectures import tiny_checkpoint

    async def attention_call(m):
        residual = (await m.model.layers[0].output)[1].clone()
        args, kwargs = await m.model.layers[1].self_attn.inputs
        return args, {k: v.clone() for k, v in kwargs.items()}, residual

    async def left_out(m):
        return await m.model.layers[0].mlp.experts.routed_experts.quant_method.inputs

    ck = str(tiny_checkpoint("qwen2_moe"))
    with asyncpp.VllmEngine(ck, dtype="float32", mode="compiled", taps=["**.inputs"]) as engine:
        assert f"{QUANT}.inputs" in engine.untappable and f"{QUANT}.inputs" not in engine.taps
        assert "called with (layer=RoutedExperts" in engine.untappable[f"{QUANT}.inputs"]
        assert "model.layers.1.self_attn.inputs" in engine.taps
        with asyncpp.trace(engine) as t:
            a = t.invoke("The quick brown fox", attention_call)
        with pytest.raises(asyncpp.TapError) as info, asyncpp.trace(engine) as t:
            t.invoke("The quick brown fox", left_out)
        msg = str(info.value)
        assert f"{QUANT}.inputs is not a tap of this VllmEngine" in msg and "left out" in msg
        assert "mode='eager'" in msg
    args, kwargs, residual = a.result
    assert args == () and set(kwargs) == {"positions", "hidden_states"}
    assert kwargs["hidden_states"].shape == residual.shape  # this request's rows
    assert kwargs["positions"].tolist() == list(range(residual.shape[0]))


def test_inputs_taps_on_views_of_one_tensor_leave_the_models_numbers_as_they_were(compiled):
    # a layer's rotary embedding takes q and k, views of its q-k-v projection, and its attention
    # takes v, another view of it: two taps mutating views of one tensor (under inductor's
    # auto-functionalization v1, which vLLM picks, this computed NaNs)
    async def read(m):
        _, q, _ = (await m.model.layers[0].self_attn.rotary_emb.inputs)[0]  # (one module, shared)
        q = q.clone()
        k = (await m.model.layers[1].self_attn.attn.inputs)[0][1].clone()
        return q, k, (await m.logits).clone()

    async def logits(m):
        return (await m.logits).clone()

    taps = ["model.layers.*.self_attn.*.inputs"]
    with asyncpp.VllmEngine(dtype="float32", mode="compiled", taps=taps) as engine:
        with asyncpp.trace(engine) as t:
            got = [t.invoke(p, read) for p in PROMPTS]
    with asyncpp.trace(compiled) as t:
        want = [t.invoke(p, logits) for p in PROMPTS]
    for g, w in zip(got, want, strict=True):
        q, k, lg = g.result
        assert torch.isfinite(q).all() and torch.isfinite(k).all()
        assert (lg - w.result).abs().max().item() <= 1e-4


def test_compiled_engines_use_auto_functionalization_v2_unless_told_otherwise():
    from asyncpp.engines.vllm.options import engine_options

    def chosen(**kw):
        config = engine_options(**kw).options.get("compilation_config") or {}
        return config.get("inductor_compile_config", {}).get("enable_auto_functionalized_v2")

    assert chosen(mode="compiled") is True and chosen() is True
    assert chosen(mode="eager") is None
    own = {"inductor_compile_config": {"enable_auto_functionalized_v2": False}, "splitting_ops": []}
    assert chosen(mode="compiled", compilation_config=own) is False
    assert chosen(mode="compiled", compilation_config='{"splitting_ops": []}') is True


def test_modes_and_options_are_checked():
    with pytest.raises(ValueError, match="mode must be 'auto', 'compiled' or 'eager'"):
        asyncpp.VllmEngine(mode="fast")
    with pytest.raises(ValueError, match="taps=... is for compiled engines"):
        asyncpp.VllmEngine(mode="eager", taps=["model.layers.*.mlp"])
    with pytest.raises(ValueError, match="not enforce_eager as well"):
        asyncpp.VllmEngine(mode="eager", enforce_eager=True)
    with pytest.raises(ValueError, match="does not run speculative decoding"):
        asyncpp.VllmEngine(speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="runs one data-parallel rank, not data_parallel_size=2"):
        asyncpp.VllmEngine(data_parallel_size=2)
    with pytest.raises(ValueError, match="needs asyncpp's worker class"):
        asyncpp.VllmEngine(worker_cls="vllm.v1.worker.cpu_worker.CPUWorker")


def test_a_second_engine_loads_the_compiled_model_from_vllms_cache(compiled):
    with asyncpp.VllmEngine(dtype="float32", mode="compiled") as again:
        assert again.compile_cached
        assert again.taps == compiled.taps


def test_greedy_tokens_equal_a_stock_compiled_vllm_engine(compiled):
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    tok = compiled.tokenizer
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]

    async def steered_nothing(m):
        async for _ in m.steps():
            await m.model.layers[1].output

    with asyncpp.generate(compiled, max_new_tokens=8, ignore_eos=True) as t:
        handles = [t.invoke(p, steered_nothing) for p in PROMPTS]
    ours = [h.tokens[0].tolist() for h in handles]

    async def stock() -> list[list[int]]:
        args = AsyncEngineArgs(
            model=compiled.options["model"],
            dtype="float32",
            enforce_eager=False,
            enable_prefix_caching=False,
            max_model_len=512,
            kv_cache_memory_bytes=2**30,
        )
        llm = AsyncLLM.from_engine_args(args)
        try:
            sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

            async def one(i, ids):
                final = None
                async for out in llm.generate({"prompt_token_ids": ids}, sp, request_id=f"stock-{i}"):
                    final = out
                return list(final.outputs[0].token_ids)

            return list(await asyncio.gather(*(one(i, ids) for i, ids in enumerate(prompts))))
        finally:
            llm.shutdown()

    assert asyncio.run(stock()) == ours
