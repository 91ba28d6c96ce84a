"""The offline tools: the program under Pulumi mocks (mockrun.py) and what is built on it, on this machine without
credentials: `plan` (plan.py, render.py, diff.py, and cost.py with the price tables *_prices.yaml), `fit` (fit.py) and
`reference` (reference.py). Nothing in the program imports them."""
