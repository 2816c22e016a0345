"""Start-up and activation: what every interpreter runs before any fix (docs/internals.md).

``startup`` (standard library only) is what the ``.pth`` line reaches; ``activation`` takes over at
the first watched import and wakes the engine; ``pth_line`` renders the ``.pth`` line;
``vllm_plugin`` is vLLM's entry point, a second trigger in every vLLM process.
"""
