"""Several routers acting as one: configuration and the fleet's view, through Redis."""
