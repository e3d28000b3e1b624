"""Models on disk: :mod:`~dpzoo.hub.load_save` (``dpzoo.load`` / ``dpzoo.save``),
:mod:`~dpzoo.hub.sharded_save` (saving an FSDP2 model), :mod:`~dpzoo.hub.checkpoint` (reading
checkpoints safely), :mod:`~dpzoo.hub.privacy_record` (the privacy metadata a saved model holds),
:mod:`~dpzoo.hub.privacy_card` (its card) and :mod:`~dpzoo.hub.deployments_registry` (its draft
record for the Deployments Registry).

Nothing is imported here, so that the torch-free modules (the record, the CLI's readers) stay
torch-free; ``dpzoo.load`` and ``dpzoo.save`` are the public names.
"""
