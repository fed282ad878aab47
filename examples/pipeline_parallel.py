"""The same blocks on a vLLM engine split over two pipeline stages and on one stage.

Each stage runs every block. A point another stage owns is a lazy remote value there; the stage
that owns it serves it, and the engine merges what the stages return. A value from a stage
downstream of this one is waited for with ``await asyncpp.pull(...)``. The block is written on the
standard view (``m.std``), so it runs unchanged on one stage, on two, and on a local engine;
``m.std.unembed`` (the logit lens) is computed on the last stage, which holds the model's head, and
comes back in the merged result (the other stages can return it, not use it).

    .venv/bin/python examples/pipeline_parallel.py
"""

import torch

import asyncpp

PROMPT = "The quick brown fox jumps over the"


async def read_and_steer(m, vec):
    first = (await m.std.layers[0].resid_out)[0, -1].clone()  # stage 0 owns layer 0; kept: cloned
    last = await m.std.layers[3].resid_out  # stage 1 owns layer 3
    last[0, -1] += vec  # a write on stage 1 (absorbed on stage 0, which does not hold layer 3)
    lens = m.std.unembed(last[0, -1])  # the logit lens of the edited stream, computed on stage 1
    logits = await m.std.logits  # stage 1's [1, 1, vocab]; a remote value on stage 0
    top = await asyncpp.pull(logits.argmax(-1))  # stage 0 waits for stage 1 here
    return {
        "layer 0 residual": first,
        "layer 3 lens": lens,
        "logits": logits.clone(),
        "top": int(top[0, -1]),
    }


def run(engine, vec):
    with asyncpp.trace(engine) as t:
        h = t.invoke(PROMPT, read_and_steer, vec)
    return h.result


def main():
    vec = torch.randn(128, generator=torch.Generator().manual_seed(0))
    results = {}
    for name, options in [("one stage", {}), ("two stages", {"pipeline_parallel_size": 2})]:
        with asyncpp.VllmEngine(dtype="float32", **options) as engine:
            results[name] = run(engine, vec)
            pulled = sum(s.get("pull_bytes", 0) for s in engine.worker_stats())
        print(f"{name}: next token {results[name]['top']}, bytes pulled across stages {pulled}")
    a, b = results["one stage"], results["two stages"]
    cos = torch.nn.functional.cosine_similarity(a["logits"].flatten(), b["logits"].flatten(), dim=0)
    print(f"same next token: {a['top'] == b['top']}; logits cosine similarity {float(cos):.6f}")
    print(f"layer 0 residual equal: {torch.allclose(a['layer 0 residual'], b['layer 0 residual'])}")
    lens = all(torch.allclose(r["layer 3 lens"], r["logits"][0, -1], atol=1e-5) for r in (a, b))
    print(f"the last layer through the logit lens equals the logits, on both: {lens}")


if __name__ == "__main__":
    main()
