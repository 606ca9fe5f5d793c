"""Models: loading, safetensors weights, 4-bit bases and experts, the families' rules, adapters and attention."""
