"""Ray Serve deployments and the app builder (a later issue): each wraps the Ray-free core."""
