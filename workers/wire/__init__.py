"""The vocabulary workers and the service share: lifecycle enums (`enums`), the pure value
types of the wire (`types`) and every REST request and response model (`models`).

A leaf package: it imports the standard library and pydantic only, so a worker node (the
`worker` install, no database or API stack) speaks the API with the service's own models.
"""
