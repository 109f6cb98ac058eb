"""vLLM's speculative_config dict, read as vLLM reads it, refused with a reason otherwise."""

import pytest

from tandem.spec_decode.config import SpeculativeConfig


def test_none_is_off():
    assert SpeculativeConfig.parse(None) is None


def test_ngram_defaults_follow_vllm():
    config = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3})
    assert config == SpeculativeConfig("ngram", 3, 5, 5, None, True)


def test_a_model_means_a_draft_model():
    config = SpeculativeConfig.parse({"model": "default", "num_speculative_tokens": 3})
    assert (config.method, config.draft_model, config.draft_dtype) == (
        "draft_model", "default", "auto",
    )  # fmt: skip
    config = SpeculativeConfig.parse(
        {"method": "draft_model", "model": "/m.gguf", "num_speculative_tokens": 2,
         "draft_dtype": "bfloat16"}
    )  # fmt: skip
    assert (config.draft_model, config.draft_dtype) == ("/m.gguf", "bfloat16")


@pytest.mark.parametrize(
    ("given", "expected"),
    [({"prompt_lookup_max": 4}, (4, 4)), ({"prompt_lookup_min": 2}, (2, 2)),
     ({"prompt_lookup_min": 2, "prompt_lookup_max": 6}, (2, 6))],
)  # fmt: skip
def test_one_lookup_bound_copies_the_other(given, expected):
    config = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, **given})
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == expected


def test_vllm_older_spelling_and_tandem_knobs():
    config = SpeculativeConfig.parse(
        {"model": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 16,
         "adaptive": False, "draft_tensor_parallel_size": 1}
    )  # fmt: skip
    assert (config.method, config.disable_by_batch_size, config.adaptive) == ("ngram", 16, False)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
        ({"method": "eagle", "num_speculative_tokens": 2}, "method='eagle'"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "needs \"model\""),
        ({"method": "ngram", "model": "/m", "num_speculative_tokens": 2}, "takes no model"),
        ({"model": "/m", "num_speculative_tokens": 2, "draft_dtype": 16}, "draft_dtype"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
          "prompt_lookup_max": 2}, "prompt_lookup_min <= prompt_lookup_max"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0},
         "prompt_lookup_min"),
        ({"method": "ngram", "num_speculative_tokens": 2, "tree": 1}, "keys \\['tree'\\]"),
        ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2},
         "draft_tensor_parallel_size=2"),
        ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0},
         "disable_by_batch_size"),
        ({"method": "ngram", "num_speculative_tokens": 2, "adaptive": "yes"}, "adaptive"),
        ("ngram", "must be a dict"),
    ],
)  # fmt: skip
def test_bad_configs_say_what_to_change(config, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(config)
