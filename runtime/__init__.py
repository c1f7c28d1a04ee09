"""The runtime: reads build artifacts and runs the model; `api` is the client API, the rooms below do one job each.

engine/ (backend-independent core and scheduler), cuda/ (the compiled engine), reference/ (the NumPy oracle),
convert/ (checkpoint -> weights artifact), text/ (tokenizer, prompts, grammars), bench/ (measurements).
"""
