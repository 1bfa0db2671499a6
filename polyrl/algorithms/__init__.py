"""RL algorithms as pure tensor functions: advantages and losses."""
