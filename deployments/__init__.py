"""Ray Serve deployments and the app builder (`deployments.app`): each wraps the Ray-free core in transport."""
