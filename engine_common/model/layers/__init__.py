"""The layers the networks in ``engine_common.model`` compose (linear, norm, rotary, attention,
MLP, mixture of experts, MXFP4 weights); each network file only wires them together."""
