"""The ``verl-npu-autopatch`` command: ``main`` parses it; one module per command and its text."""
