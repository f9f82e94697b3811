"""HTTP routes: a few lines each, delegating to the serving modules."""
