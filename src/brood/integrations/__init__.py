"""brood in other frameworks, each an optional extra imported only by its own module:
`brood.integrations.openenv` (pip install 'rlm-brood[openenv]'). Importing brood, or this
package, imports none of them."""
