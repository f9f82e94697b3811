"""Tally operator: reconciles CompletionService resources into GPU Deployments, Services and PDBs."""
