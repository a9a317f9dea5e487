"""brood inside other frameworks; each module imports its framework's SDK (an extra) itself,
and `import brood` imports none of them."""
