"""The embedded inference engine: a real server process for a Hugging Face causal LM.

It speaks the subset of SGLang's native HTTP API that miles uses (plus OpenAI-compatible
endpoints), so the controller drives it exactly as it drives SGLang. Run it with
``python -m miles.engine --model-path DIR --port P``.
"""
