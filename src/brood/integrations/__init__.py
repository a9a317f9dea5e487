"""brood in other frameworks, each an optional extra imported only by its own module:
`brood.integrations.openenv` (the `[openenv]` extra) and `brood.integrations.verifiers`
(the `[verifiers]` extra). Importing brood, or this package, imports none of them."""
