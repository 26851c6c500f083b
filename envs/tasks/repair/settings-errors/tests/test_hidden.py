import os
import tempfile
import unittest
from unittest import mock

from appconfig import ConfigError, MissingSetting, Settings


class HiddenSettingsTest(unittest.TestCase):
    def test_malformed_without_default(self):
        s = Settings({"TIMEOUT": "ten", "RATE": "1,5"})
        for call in (lambda: s.int("TIMEOUT"), lambda: s.float("RATE")):
            with self.assertRaises(ConfigError) as cm:
                call()
            self.assertNotIsInstance(cm.exception, MissingSetting)
        with self.assertRaisesRegex(ConfigError, "TIMEOUT"):
            s.int("TIMEOUT")

    def test_empty_value_is_malformed(self):
        s = Settings({"X_N": "", "X_FLAG": " "}, prefix="X_")
        with self.assertRaisesRegex(ConfigError, "X_N"):
            s.int("N", 5)
        with self.assertRaisesRegex(ConfigError, "X_FLAG"):
            s.bool("FLAG", True)
        self.assertEqual(s.str("N", "d"), "")

    def test_absent_still_falls_back(self):
        s = Settings({}, prefix="P_")
        self.assertEqual((s.int("A", 1), s.float("B", 2.5), s.bool("C", False), s.port("D", 80), s.list("E", [])),
                         (1, 2.5, False, 80, []))
        with self.assertRaises(MissingSetting) as cm:
            s.port("D")
        self.assertIn("P_D", str(cm.exception))

    def test_good_values_still_work(self):
        s = Settings({"A": "-3", "B": "1e3", "C": "OFF", "D": "65535", "E": "x;y", "F": "0"})
        self.assertEqual((s.int("A", 0), s.float("B"), s.bool("C", True), s.port("D"), s.list("E", sep=";")),
                         (-3, 1000.0, False, 65535, ["x", "y"]))
        with self.assertRaises(ConfigError):
            s.port("F", 1)

    def test_from_environ(self):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, ".env")
            with open(path, "w") as f:
                f.write("SVC_PORT=8000\nSVC_DEBUG=on\nSVC_LIMIT=lots\n")
            with mock.patch.dict(os.environ, {"SVC_PORT": "9000"}):
                s = Settings.from_environ("SVC_", path)
        self.assertEqual((s.port("PORT"), s.bool("DEBUG")), (9000, True))
        with self.assertRaisesRegex(ConfigError, "SVC_LIMIT"):
            s.int("LIMIT", 10)


if __name__ == "__main__":
    unittest.main()
