"""Lowering: our Inductor lowerings of flex_attention (forward, backward), site planning and the
marker pass that switches them on. Registered from one place: ``registration.install()``."""
