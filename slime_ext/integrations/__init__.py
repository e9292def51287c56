"""Integrations of slime-ext into host RL frameworks. :mod:`.slime` is the one for THUDM/slime."""
