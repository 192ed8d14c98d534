"""Prefill/decode disaggregation (seed §7): a request's KV handed from one instance to another."""
