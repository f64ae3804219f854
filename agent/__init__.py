"""The Hivenet agent daemon, run beside each inference engine."""
