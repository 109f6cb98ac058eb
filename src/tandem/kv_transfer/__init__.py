"""Prefill/decode disaggregation: a prefill instance keeps a finished prompt's KV blocks and a
decode instance pulls them over a torch.distributed pair group (see docs/disaggregation.md)."""
