# kvguard: two commands on a fresh Debian/Ubuntu machine with Python >= 3.11.
#   make up    set everything up and run the embedded stack on 127.0.0.1
#   make test  set everything up and run the whole test suite with the lint and type gates
VENV := .venv/bin
PYTEST_ARGS ?=

.PHONY: up test lint typecheck unit bootstrap bench

bootstrap:
	@./scripts/bootstrap.sh

up: bootstrap
	$(VENV)/kvguard up

lint: bootstrap
	$(VENV)/ruff check .
	$(VENV)/ruff format --check .

typecheck: bootstrap
	$(VENV)/mypy

unit: bootstrap
	$(VENV)/pytest $(PYTEST_ARGS)

test: lint typecheck unit

bench: bootstrap
	$(VENV)/python -m bench.run
