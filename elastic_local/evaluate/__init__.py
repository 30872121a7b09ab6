"""`elastic-local eval`: accuracy per budget, budget control and precision on the task corpus."""
