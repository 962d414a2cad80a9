"""The OpenAI surface: the request schemas and what each engine kind takes."""
