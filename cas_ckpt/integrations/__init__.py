"""Training-framework integrations. Each imports its framework lazily: none is required."""
