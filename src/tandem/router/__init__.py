"""`tandem router`: one OpenAI-compatible front for disaggregated prefill and decode instances."""
