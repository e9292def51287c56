"""The layer spec the host tests name with Megatron-LM's ``--spec mrl_spec THD_LAYER_SPEC``.

megatron-core's local layer spec (``--transformer-impl local``) with slime-ext's THD core attention
(:func:`slime_ext.training.thd_attention.get_thd_layer_spec`): Megatron-RL packs several sequences into one row and
passes ``PackedSeqParams``, which megatron-core's local ``DotProductAttention`` refuses, and TransformerEngine needs
CUDA. Megatron-LM's ``gpt_builder`` imports this module attribute (``import_module(args.spec)``); the worker puts
this folder on ``sys.path``.
"""

from slime_ext.training.thd_attention import get_thd_layer_spec

THD_LAYER_SPEC = get_thd_layer_spec()
