"""A JSON Schema the tiny random models can satisfy: nested objects, an array, an enum, required
fields, and every string bounded by its pattern (a random model ends a string only where the
grammar makes it)."""

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z]{1,10}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog", "none"]},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string", "pattern": "^[a-z ]{1,12}$"},
                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "pet", "address", "tags"],
    "additionalProperties": False,
}
