"""turnlog: an event-sourced session store for agentic RL rollouts."""

__version__ = "0.1.0"
