"""The layer above the services: the `specd` command (main.py) and what it runs besides them,
`specd up` (stack.py), `specd top` (top.py) and `specd bench` (bench/, needs the `bench` extra)."""
