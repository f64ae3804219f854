"""What the router and the agent share: frames, messages, tokens, error codes."""
