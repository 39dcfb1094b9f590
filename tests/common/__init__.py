"""ebb.common: the job spec and its checks, schemas and fuzzed decoders, the output protocol,
metrics, roles, supervision."""
