"""The project as a user meets it: README, docs, examples, packaging, integrations, and the
claim map, mutants and structure that keep the rest honest."""
