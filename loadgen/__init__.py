"""loadgen: a benchmark client for LLM serving endpoints (Baton gRPC, OpenAI-compatible HTTP), with
vLLM `bench serve` metric definitions and JSON field names. `loadgen run` / `loadgen compare`;
see docs/LOADGEN.md."""
