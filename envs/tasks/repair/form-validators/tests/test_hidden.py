import unittest

from formcheck import Schema, is_int, matches, max_len, min_len, one_of, required


class HiddenSchemaTest(unittest.TestCase):
    def test_each_field_alone(self):
        schema = Schema({
            "a": [required()],
            "b": [min_len(4)],
            "c": [is_int(1, 5)],
            "d": [matches(r"[a-z]+", "lower-case only")],
            "e": [one_of("x", "y")],
        })
        good = {"a": "1", "b": "long", "c": "3", "d": "abc", "e": "y"}
        self.assertEqual(schema.errors(good), {})
        bad_values = {"a": "", "b": "no", "c": "9", "d": "ABC", "e": "z"}
        messages = {"a": "is required", "b": "must be at least 4 characters", "c": "must be at most 5",
                    "d": "lower-case only", "e": "must be one of x, y"}
        for field, value in bad_values.items():
            self.assertEqual(schema.errors(dict(good, **{field: value})), {field: messages[field]}, field)

    def test_rule_order_within_field(self):
        schema = Schema({"pin": [required(), is_int(), min_len(4), max_len(4)], "other": [required()]})
        self.assertEqual(schema.errors({"pin": "12a", "other": "o"}), {"pin": "must be a whole number"})
        self.assertEqual(schema.errors({"pin": "123", "other": "o"}), {"pin": "must be at least 4 characters"})
        self.assertEqual(schema.errors({"pin": "12345"}), {"pin": "must be at most 4 characters", "other": "is required"})

    def test_two_schemas_do_not_interfere(self):
        s1 = Schema({"name": [required()], "tag": [max_len(3)]})
        s2 = Schema({"tag": [required(), min_len(2)], "name": [max_len(1)]})
        data = {"name": "bob", "tag": "x"}
        self.assertEqual(s1.errors(data), {})
        self.assertEqual(s2.errors(data), {"tag": "must be at least 2 characters", "name": "must be at most 1 characters"})
        self.assertEqual(s1.clean({"name": " z ", "tag": "ab"}), {"name": "z", "tag": "ab"})


if __name__ == "__main__":
    unittest.main()
