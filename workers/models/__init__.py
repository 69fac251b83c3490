"""Model implementations, weight loading, and the tiny test-model maker."""
