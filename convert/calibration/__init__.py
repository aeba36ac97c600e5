"""The calibration pass AWQ and llama.cpp's importance matrix share: the calibration text (``text``), each
architecture's decoder block and the groups of linears that read one input (``layouts``), the streaming pass
through the blocks with its input statistics (``blocks``) and the modules it records (``hooks``)."""
