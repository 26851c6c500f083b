import unittest

from appconfig import ConfigError, MissingSetting, Settings


class SettingsTest(unittest.TestCase):
    def setUp(self):
        self.s = Settings({
            "APP_PORT": "8080", "APP_DEBUG": "yes", "APP_RATIO": "0.25", "APP_HOSTS": "a.example, b.example,",
            "APP_WORKERS": "4x", "APP_VERBOSE": "maybe", "APP_ADMIN_PORT": "99999",
        }, prefix="APP_")

    def test_present_values(self):
        self.assertEqual(self.s.port("PORT"), 8080)
        self.assertIs(self.s.bool("DEBUG"), True)
        self.assertEqual(self.s.float("RATIO"), 0.25)
        self.assertEqual(self.s.list("HOSTS"), ["a.example", "b.example"])

    def test_absent_uses_default(self):
        self.assertEqual(self.s.int("RETRIES", 3), 3)
        self.assertIsNone(self.s.str("SENTRY_DSN", None))

    def test_absent_without_default(self):
        with self.assertRaises(MissingSetting):
            self.s.str("SECRET_KEY")

    def test_malformed_int_is_an_error(self):
        with self.assertRaisesRegex(ConfigError, "APP_WORKERS"):
            self.s.int("WORKERS", 1)

    def test_malformed_bool_is_an_error(self):
        with self.assertRaisesRegex(ConfigError, "APP_VERBOSE"):
            self.s.bool("VERBOSE", False)

    def test_port_out_of_range(self):
        with self.assertRaisesRegex(ConfigError, "APP_ADMIN_PORT"):
            self.s.port("ADMIN_PORT", 9000)


if __name__ == "__main__":
    unittest.main()
