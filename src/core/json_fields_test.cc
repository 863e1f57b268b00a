#include "core/json_fields.h"

#include <gtest/gtest.h>

namespace ferry {
namespace {

using Json = nlohmann::json;

std::string Message(const Status& s) { return s.message(); }

TEST(JsonFields, RequiredFieldsNameThePathAndWhatIsWrong) {
    const Json j = Json::parse(R"({"a":1,"s":"x","b":true,"o":{"n":-2},"arr":[1,2,"x"]})");
    JsonFields f(j, "msg");
    EXPECT_EQ(f.Int("a", 0, 5).value(), 1);
    EXPECT_EQ(Message(f.Int("a", 2, 5).status()), "field 'msg.a' = 1 is outside 2..5");
    EXPECT_EQ(Message(f.String("a").status()), "field 'msg.a' must be a string, not an integer");
    EXPECT_EQ(Message(f.Bool("missing").status()), "field 'msg.missing' is missing");
    EXPECT_EQ(Message(f.String("s", 0).status()), "field 'msg.s' is longer than 0 characters");
    EXPECT_TRUE(f.Bool("b").value());
    auto o = f.Object("o");
    ASSERT_TRUE(o.ok());
    EXPECT_EQ(Message(o->Uint("n").status()), "field 'msg.o.n' must not be negative");
    EXPECT_EQ(Message(f.IntArray<int>("arr", 0, 9, 8).status()),
              "field 'msg.arr[2]' must be an integer, not a string");
    EXPECT_EQ(Message(f.IntArray<int>("arr", 0, 9, 2).status()),
              "field 'msg.arr' has more than 2 elements");
    const Json big = Json::parse(R"({"u":18446744073709551615})");
    EXPECT_EQ(Message(JsonFields(big).Int("u", 0, 10).status()), "field 'u' is outside 0..10");
    EXPECT_EQ(JsonFields::ClampedInt(big["u"]), INT64_MAX);
    EXPECT_EQ(Message(JsonFields(Json::array()).Int("x", 0, 1).status()),
              "'message' must be an object, not an array");
}

TEST(JsonFields, OptionalFieldsTreatAbsentAndNullAlikeAndStillCheckTypes) {
    const Json j = Json::parse(R"({"n":null,"i":7,"s":"x","b":false,"d":0.5,"bad":"7"})");
    JsonFields f(j);
    EXPECT_EQ(f.Given("n"), nullptr);
    EXPECT_EQ(f.Given("absent"), nullptr);
    EXPECT_NE(f.Given("i"), nullptr);
    EXPECT_FALSE(f.OptInt("n", 0, 9).value().has_value());
    EXPECT_FALSE(f.OptString("absent").value().has_value());
    EXPECT_EQ(f.OptInt("i", 0, 9).value(), 7);
    EXPECT_EQ(f.OptString("s").value(), "x");
    EXPECT_EQ(f.OptBool("b").value(), false);
    EXPECT_EQ(f.OptNumber("d").value(), 0.5);
    EXPECT_EQ(f.OptNumber("i").value(), 7.0);  // an integer is a number
    EXPECT_EQ(Message(f.OptInt("bad", 0, 9).status()),
              "field 'bad' must be an integer, not a string");
    EXPECT_EQ(Message(f.OptInt("i", 0, 5).status()), "field 'i' = 7 is outside 0..5");
    EXPECT_EQ(Message(f.OptBool("s").status()), "field 's' must be a boolean, not a string");
}

}  // namespace
}  // namespace ferry
