"""Query routing: sentence embeddings + classifier, language id, routing by observed acceptance (issue 4)."""
