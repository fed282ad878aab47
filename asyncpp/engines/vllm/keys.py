"""Names the driver and asyncpp's vLLM worker share (importing this does not import vLLM)."""

EXTRA_KEY = "asyncpp"  # SamplingParams.extra_args: the packed block
ID_KEY = "asyncpp_id"  # SamplingParams.extra_args: the caller's id for the request
NUM_KEY = "asyncpp_num"  # SamplingParams.extra_args: the request's number (cross-stage pulls)
ALIASES = {"logits": "logits_processor", "samples": "sampler"}
EAGER_KEY = "asyncpp_eager"  # SamplingParams.extra_args: run the request's steps eagerly (auto mode)
LIVE_KEY = "asyncpp_live"  # SamplingParams.extra_args: the caller follows the tokens as sampled
OURS = (EXTRA_KEY, ID_KEY, NUM_KEY, EAGER_KEY, LIVE_KEY)  # what a client's own extra_args never carry
